"""What the families' tiny-model builders share: tokenizers built offline (a byte-level BPE CLIP tokenizer and a
Unigram T5 one) and seeded construction.

Real pipelines download these; the tiny ones are made here from a small vocabulary, with
`transformers`' own classes, so that the loading code and the pipelines run unchanged on them. Both
know the words of the synthetic datasets' prompts whole (`WORDS`), so a prompt is a few tokens.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

__all__ = ["WORDS", "clip_tokenizer", "seeded", "t5_tokenizer"]

WORDS = ("a", "an", "the", "of", "on", "in", "with", "and", "photo", "red", "green", "blue", "yellow", "white",
         "black", "orange", "purple", "circle", "square", "triangle", "background", "cat", "dog", "sitting",
         "chair", "painting", "image", "small", "large", "bright", "dark", "video", "moving", "left", "right")
_PUNCTUATION = tuple(",.!?'-:;()")


def clip_tokenizer(max_length: int, words: Iterable[str] = WORDS):
    """A CLIPTokenizer: the 256 byte symbols, each also as a word end, merges spelling `words`, and the two
    CLIP specials; `model_max_length` is `max_length` (the text model's positions must cover it)."""
    from tokenizers import pre_tokenizers
    from transformers import CLIPTokenizer

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab: dict[str, int] = {}
    for symbol in [*alphabet, *(a + "</w>" for a in alphabet)]:
        vocab.setdefault(symbol, len(vocab))
    merges: list[tuple[str, str]] = []
    for word in words:
        if len(word) < 2:
            continue
        left = word[0]
        for i, char in enumerate(word[1:], start=1):
            right = char + ("</w>" if i == len(word) - 1 else "")
            if (left, right) not in merges:
                merges.append((left, right))
            left = left + right
            vocab.setdefault(left, len(vocab))
    for special in ("<|startoftext|>", "<|endoftext|>"):
        vocab.setdefault(special, len(vocab))
    return CLIPTokenizer(vocab=vocab, merges=merges, model_max_length=max_length)


def t5_tokenizer(words: Iterable[str] = WORDS):
    """A Unigram T5Tokenizer: <pad>=0, </s>=1, <unk>=2, then "▁", characters, "▁"+character and whole words."""
    from transformers import T5Tokenizer

    chars = [*"abcdefghijklmnopqrstuvwxyz", *"ABCDEFGHIJKLMNOPQRSTUVWXYZ", *"0123456789", *_PUNCTUATION]
    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -2.0)]
    pieces += [(c, -6.0) for c in chars] + [("\u2581" + c, -5.0) for c in chars]
    pieces += [("\u2581" + w, -1.0) for w in words if len(w) > 1]
    return T5Tokenizer(vocab=pieces, extra_ids=0)


def seeded(seed: int, build: Callable[[], Any]) -> Any:
    """`build()` with torch's global generator seeded by `seed` (and restored after): a component's random weights
    depend on its own seed only, not on what was built before it."""
    import torch

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(int(seed))
        return build()
