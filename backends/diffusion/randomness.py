"""Randomness derived from --seed, never from the global stream.

Every random draw of the backend (the shuffle order of an epoch, a sample's VAE latent, noise and
timestep, the LoRA initialisation, dropout) takes a generator seeded from a hash of the run seed
and a *purpose path*: the epoch, the sample's identity and what the draw is for. A unit therefore
draws the same numbers whether it runs in the unsplit loop or in stage 2 of a split run, which is
what makes `sft` and `sft:data_process` + `sft:train` produce the same losses and weights.
"""

from __future__ import annotations

import hashlib
import json
from contextlib import contextmanager
from typing import Any, Iterator


# json.dumps(..., separators=(",", ":")) builds a new encoder on every call; stage 2 derives three seeds
# per sample (latent, noise, timestep), so one encoder is kept. Same text, so the same seeds.
_ENCODE = json.JSONEncoder(separators=(",", ":")).encode


def derive_seed(seed: int, *purpose: Any) -> int:
    """A 63-bit seed from the run seed and a purpose path (JSON-serialisable parts)."""
    text = _ENCODE([int(seed), [str(p) for p in purpose]])
    return int.from_bytes(hashlib.sha256(text.encode("utf-8")).digest()[:8], "big") & ((1 << 63) - 1)


def generator(seed: int, *purpose: Any):
    """A CPU torch.Generator for one purpose (draw on the CPU, then move: results do not depend on the device)."""
    import torch

    gen = torch.Generator(device="cpu")
    gen.manual_seed(derive_seed(seed, *purpose))
    return gen


@contextmanager
def seeded_global_stream(seed: int, *purpose: Any) -> Iterator[None]:
    """Run code that draws from torch's global stream (peft's LoRA init, dropout) from a derived seed.

    The global state is forked, so code outside the block sees no change.
    """
    import torch

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(derive_seed(seed, *purpose))
        yield


def permutation(n: int, seed: int, *purpose: Any) -> list[int]:
    """A random permutation of range(n) for one purpose (e.g. ("shuffle", epoch))."""
    import torch

    return torch.randperm(n, generator=generator(seed, *purpose)).tolist()
