"""Test-sized models of a DiffSynth pipeline, laid out as DiffSynth's `./models` holds a download.

DiffSynth's `--model_id_with_origin_paths "org/name:sub/file.safetensors"` downloads into `./models/org/name/` only
the files its patterns name. The tiny layout here is that folder for the pipeline's example command, with random
weights in the release's own key layout (a transformers CLIP text encoder's keys start with `text_model.`, as in the
released `text_encoder/model.safetensors`) and the component's `config.json` beside its weights, which is how
unitgraph recognises a model DiffSynth's hash table does not know (models.py). A family of unitgraph's writes its
own pipelines' (`write_diffsynth_models` in its folder's `diffsynth` module), at its `test` sizes where DiffSynth's
classes allow them; this module writes those of DiffSynth's pipelines of no family (`OWN`).
"""

from __future__ import annotations

import inspect
import json
import os
from pathlib import Path
from typing import Any, Callable, Optional

from ..errors import BackendError

__all__ = ["OWN", "smallest_entry", "write_released_shards", "write_smallest_model", "write_tiny_models",
           "writers"]


def _family_with_slot(class_name: str) -> Any:
    """unitgraph's family with a model slot of the diffusers class `class_name` (its tiny builders are reused)."""
    from .. import registry

    return next(f for f in registry.families() if any(s.class_name == class_name for s in f.slots))


# Ideogram 4 at test size. Its text encoder taps Qwen3-VL's hidden states at 13 fixed layers up to layer 35, so the
# smallest it allows has 36 layers (here 16 wide); its VAE's latents are normalised by 128 fixed statistics, so the
# VAE keeps 32 latent channels (a 2x2 patch of them is the DiT's 128 inputs), at 32 channels wide.
IDEOGRAM4_TEXT = {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 36, "num_attention_heads": 2,
                  "num_key_value_heads": 1, "head_dim": 8}
IDEOGRAM4_DIT = {"emb_dim": 32, "num_layers": 2, "num_heads": 2, "intermediate_size": 64, "adanln_dim": 16,
                 "in_channels": 128, "rope_theta": 5000000, "mrope_section": [4, 2, 2], "norm_eps": 1e-5}
# Qwen3-VL's chat format for a text-only conversation whose content may be a list of parts, as Ideogram 4's prompt
# unit sends it (the real tokenizer's template does the same for text parts)
QWEN3_VL_TEXT_TEMPLATE = (
    "{%- for message in messages -%}<|im_start|>{{ message['role'] }}\n"
    "{%- if message['content'] is string -%}{{ message['content'] }}"
    "{%- else -%}{%- for part in message['content'] -%}{%- if part['type'] == 'text' -%}{{ part['text'] }}"
    "{%- endif -%}{%- endfor -%}{%- endif -%}<|im_end|>\n{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_start|>assistant\n{%- endif -%}")
IDEOGRAM4_VAE = {"block_out_channels": [32, 32, 32, 32], "latent_channels": 32, "layers_per_block": 1,
                 "norm_num_groups": 32}


def _ideogram4(outdir: Path, seed: int) -> dict[str, Any]:
    import torch
    from diffsynth.models.ideogram4_dit import Ideogram4DiT
    from diffsynth.models.ideogram4_text_encoder import QWEN3_VL_ACTIVATION_LAYERS
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModel

    model_id = "DiffSynth-Studio/ideogram-4-bf16-repackage"
    root = outdir / model_id
    family = _family_with_slot("AutoencoderKLFlux2")
    tokenizer = family.tiny_module().build_tokenizer()
    tokenizer.chat_template = QWEN3_VL_TEXT_TEMPLATE
    tokenizer_folder = outdir / "ideogram-ai" / "ideogram-4-fp8" / "tokenizer"  # where its train.py looks by default
    tokenizer.save_pretrained(str(tokenizer_folder))
    vocab = len(tokenizer)
    text = {**IDEOGRAM4_TEXT, "vocab_size": vocab, "max_position_embeddings": 4096, "rms_norm_eps": 1e-6,
            "rope_parameters": {"mrope_interleaved": True, "mrope_section": [2, 1, 1], "rope_theta": 5000000,
                                "rope_type": "default"}, "model_type": "qwen3_vl_text", "tie_word_embeddings": False}
    vision = {"depth": 1, "hidden_size": 16, "intermediate_size": 32, "num_heads": 2, "out_hidden_size": 16,
              "patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2, "num_position_embeddings": 16,
              "deepstack_visual_indexes": [0], "model_type": "qwen3_vl_vision"}
    config = AutoConfig.for_model("qwen3_vl", text_config=text, vision_config=vision, tie_word_embeddings=False)
    torch.manual_seed(seed + 2)
    text_encoder = AutoModel.from_config(config)
    (root / "text_encoder").mkdir(parents=True, exist_ok=True)
    config.save_pretrained(str(root / "text_encoder"))
    save_file({k: v.contiguous() for k, v in text_encoder.state_dict().items()},
              str(root / "text_encoder" / "model.safetensors"))
    dit_config = {**IDEOGRAM4_DIT, "llm_features_dim": IDEOGRAM4_TEXT["hidden_size"] * len(QWEN3_VL_ACTIVATION_LAYERS)}
    torch.manual_seed(seed)
    dit = Ideogram4DiT(config=dict(dit_config))
    (root / "transformer").mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in dit.state_dict().items()},
              str(root / "transformer" / "diffusion_pytorch_model.safetensors"))
    (root / "transformer" / "config.json").write_text(json.dumps(dit_config, indent=1) + "\n", encoding="utf-8")
    _seeded_vae(seed + 1).save_pretrained(str(root / "vae"))
    files = ["transformer/diffusion_pytorch_model.safetensors", "text_encoder/model.safetensors",
             "vae/diffusion_pytorch_model.safetensors"]
    return {"model_id_with_origin_paths": ",".join(f"{model_id}:{f}" for f in files),
            "tokenizer_path": str(tokenizer_folder)}


def smallest_entry(module: str, attribute: str, converted: bool = False) -> dict[str, Any]:
    """The entry of DiffSynth's model-config table that builds the pipeline's model `attribute` smallest, of those
    that load a file in the class's own layout (no state-dict converter, not prequantized; with `converted`, those
    with a converter too): how a test writes a model whose class fixes its width (a text encoder offered at a few
    released sizes only)."""
    from diffsynth.configs import MODEL_CONFIGS

    from .glue import glue_for
    from .models import model_attributes, pipeline_class_of, skeleton

    names = {n for n, a in model_attributes(pipeline_class_of(glue_for(module))).items() if a == attribute}
    entries = [c for c in MODEL_CONFIGS if c["model_name"] in names and not c.get("quant_config")
               and (converted or not c.get("state_dict_converter"))]
    if not entries:
        raise BackendError(f"DiffSynth's table has no entry of diffsynth:{module}'s {attribute} in its own layout")
    return min(entries, key=lambda c: sum(p.numel() for p in skeleton(c).parameters()))


def write_smallest_model(folder: Path, module: str, attribute: str, seed: int, name: str = "model.safetensors") -> Path:
    """The pipeline's model `attribute` at the smallest size DiffSynth's table builds it (`smallest_entry`), with
    random N(0, 0.02) weights (norm scales 1) in bf16, as `folder/name`; DiffSynth knows the file by its key hash.
    The weights depend only on the entry and `seed`, so a process writes them once and links (or copies) the same
    file to every further folder (`_once`): a Qwen3 0.6B encoder, the smallest some pipelines take, is 1.2 GB."""
    from safetensors.torch import save_file

    from .models import skeleton

    entry = smallest_entry(module, attribute)
    memo = (entry["model_class"], json.dumps(entry.get("extra_kwargs", {}), sort_keys=True), seed)
    return _once(folder / name, memo, lambda target: save_file(_random_weights(skeleton(entry), seed), str(target)))


def write_released_shards(folder: Path, module: str, attribute: str, seed: int, released: Callable[[str], str],
                          shards: int, name: str = "model") -> list[Path]:
    """The pipeline's model `attribute` at the size its class fixes (the smallest entry of DiffSynth's table, a
    state-dict converter allowed), with random N(0, 0.02) weights in bf16, as a transformers release keeps a large
    model: `shards` files `NAME-0000i-of-0000n.safetensors` of about equal size, each key under the release's name
    (`released`: the inverse of the entry's converter), and `NAME.safetensors.index.json` mapping each key to its
    file. A release written so has the release's key hash, by which DiffSynth's table knows it. One shard is held in
    memory at a time (an 8 B-parameter encoder: 4 GB per shard of 4), and each is written once a session (`_once`)."""
    import math

    from safetensors.torch import save_file

    from .models import skeleton

    entry = smallest_entry(module, attribute, converted=True)
    model = skeleton(entry)
    sizes = {k: math.prod(v.shape) * 2 for k, v in model.state_dict().items()}
    share, groups, filled = sum(sizes.values()) / shards, [[] for _ in range(shards)], 0
    for key, size in sizes.items():  # in the model's order, a new file once a file holds its share
        groups[min(int(filled // share), shards - 1)].append(key)
        filled += size
    folder.mkdir(parents=True, exist_ok=True)
    files, weight_map = [], {}
    for index, keys in enumerate(groups):
        file = folder / f"{name}-{index + 1:05d}-of-{shards:05d}.safetensors"
        weight_map.update({released(k): file.name for k in keys})
        memo = (entry["model_hash"], entry["model_class"], seed, shards, index)
        files.append(_once(file, memo, lambda target, keys=set(keys), index=index: save_file(
            {released(k): v for k, v in _random_weights(model, seed + index, names=keys).items()}, str(target))))
    index_file = {"metadata": {"total_size": sum(sizes.values())}, "weight_map": dict(sorted(weight_map.items()))}
    (folder / f"{name}.safetensors.index.json").write_text(json.dumps(index_file, indent=1) + "\n", encoding="utf-8")
    return files


def _once(target: Path, memo: tuple, write: Any) -> Path:
    """`target` written by `write(target)`, or linked to (else copied from) the file this process already wrote for
    `memo`: the large fixed-size models are written once a session."""
    import shutil

    target.parent.mkdir(parents=True, exist_ok=True)
    copies = _WRITTEN.setdefault(memo, [])
    earlier = next((p for p in copies if p.is_file()), None)  # a copy not removed since (a test's folder may be)
    if earlier is not None:
        try:
            os.link(earlier, target)
        except OSError:
            shutil.copyfile(earlier, target)
    else:
        write(target)
    copies.append(target)
    return target


_WRITTEN: dict[tuple, list[Path]] = {}  # memo -> the files this process wrote or linked for it


def _random_weights(model: Any, seed: int, prefix: str = "", names: Optional[set] = None) -> dict[str, Any]:
    """{prefix + name: tensor} of a meta-device `model` (of its `names` only, when given) filled with N(0, 0.02)
    (norm scales 1) in bf16, parameter by parameter, so a 2 B-parameter model never holds more than its bf16 copy
    and one fp32 tensor."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    out = {}
    for name, param in model.state_dict().items():
        if names is not None and name not in names:
            continue
        value = torch.empty(param.shape, dtype=torch.float32)
        value.fill_(1.0) if "norm" in name else value.normal_(0.0, 0.02, generator=generator)
        out[prefix + name] = value.to(torch.bfloat16)
    return out


def _anima(outdir: Path, seed: int) -> dict[str, Any]:
    """Anima as its LoRA example downloads it (circlestone-labs/Anima's split_files), each file in the release's own
    layout, which DiffSynth's table knows by its key hash. Every class of it fixes its size, so each is its table
    entry's with random N(0, 0.02) weights in bf16: the DiT AnimaDiT's only configuration (2.09 B parameters, 4.2 GB,
    its keys under `net.` as released), the text encoder the 0.6 B Qwen3 one (shared with the other pipelines that
    take it), the VAE the 16-channel video VAE its table entry names (127 M, its keys without its class's `model.`).
    The tokenizers are test-size ones where its train.py looks by default: a Qwen tokenizer at the root of
    Qwen/Qwen3-0.6B/ and a T5 one in stabilityai/stable-diffusion-3.5-large/tokenizer_3/."""
    from safetensors.torch import save_file

    from ..models.tiny_tokenizers import t5_tokenizer
    from .models import skeleton

    model_id = "circlestone-labs/Anima"
    root = outdir / model_id / "split_files"
    _family_with_slot("AutoencoderKLFlux2").tiny_module().build_tokenizer().save_pretrained(
        str(outdir / "Qwen" / "Qwen3-0.6B"))
    t5_tokenizer().save_pretrained(str(outdir / "stabilityai" / "stable-diffusion-3.5-large" / "tokenizer_3"))
    write_smallest_model(root / "text_encoders", "anima_image", "text_encoder", seed + 2, "qwen_3_06b_base.safetensors")
    dit = smallest_entry("anima_image", "dit", converted=True)
    _once(root / "diffusion_models" / "anima-preview.safetensors", (dit["model_hash"], seed),
          lambda target: save_file(_random_weights(skeleton(dit), seed, prefix="net."), str(target)))
    vae = smallest_entry("anima_image", "vae", converted=True)
    (root / "vae").mkdir(parents=True, exist_ok=True)
    save_file({k.removeprefix("model."): v for k, v in _random_weights(skeleton(vae), seed + 1).items()},
              str(root / "vae" / "qwen_image_vae.safetensors"))
    files = ["split_files/diffusion_models/anima-preview.safetensors",
             "split_files/text_encoders/qwen_3_06b_base.safetensors", "split_files/vae/qwen_image_vae.safetensors"]
    return {"model_id_with_origin_paths": ",".join(f"{model_id}:{f}" for f in files),
            "tokenizer_path": "Qwen/Qwen3-0.6B:./",
            "tokenizer_t5xxl_path": "stabilityai/stable-diffusion-3.5-large:tokenizer_3/"}


# ERNIE-Image's DiT at test size (the class takes every size; its text projection takes the fixed encoder's 3072
# features); its rotary axes add up to the head's 16 channels, as the release's (32, 48, 48) add up to its 128
ERNIE_IMAGE_DIT = {"hidden_size": 32, "num_attention_heads": 2, "num_layers": 2, "ffn_hidden_size": 64,
                   "in_channels": 128, "out_channels": 128, "patch_size": 1, "text_in_dim": 3072,
                   "rope_axes_dim": [4, 6, 6]}
# the text encoder's folder as released: a Mistral 3 checkpoint whose language model DiffSynth's class keeps
ERNIE_IMAGE_TEXT_CONFIG = {"architectures": ["Mistral3ForConditionalGeneration"], "model_type": "mistral3",
                           "text_config": {"model_type": "ministral3", "hidden_size": 3072, "num_hidden_layers": 26,
                                           "vocab_size": 131072}}


def _ernie_image(outdir: Path, seed: int) -> dict[str, Any]:
    """ERNIE-Image as its LoRA example downloads it (PaddlePaddle/ERNIE-Image's transformer, text_encoder and vae).
    Its text encoder class fixes Ministral 3's 3.43 B parameters: the file is that model with random N(0, 0.02)
    weights in bf16 (6.9 GB, written once a session and linked into each folder), its keys under the release's
    `language_model.model.` (DiffSynth's converter keeps those); its `config.json` is the release's kind, so the
    file, whose key hash is not the release's (no vision tower), is recognised by its class. The DiT is test-sized
    (`ERNIE_IMAGE_DIT`), the VAE the one Ideogram 4's test uses (32 latent channels, a 2x2 patch of them the
    DiT's 128 inputs), the tokenizer a test-size one where its train.py looks by default."""
    from safetensors.torch import save_file

    from .models import skeleton

    model_id = "PaddlePaddle/ERNIE-Image"
    root = outdir / model_id
    _family_with_slot("AutoencoderKLFlux2").tiny_module().build_tokenizer().save_pretrained(str(root / "tokenizer"))
    text = smallest_entry("ernie_image", "text_encoder", converted=True)
    (root / "text_encoder").mkdir(parents=True, exist_ok=True)
    (root / "text_encoder" / "config.json").write_text(json.dumps(ERNIE_IMAGE_TEXT_CONFIG, indent=1) + "\n",
                                                       encoding="utf-8")
    _once(root / "text_encoder" / "model.safetensors", (text["model_hash"], seed + 2),
          lambda target: save_file(_random_weights(skeleton(text), seed + 2, prefix="language_model."), str(target)))
    dit = smallest_entry("ernie_image", "dit")
    (root / "transformer").mkdir(parents=True, exist_ok=True)
    (root / "transformer" / "config.json").write_text(json.dumps(ERNIE_IMAGE_DIT, indent=1) + "\n", encoding="utf-8")
    save_file(_random_weights(skeleton(dict(dit, extra_kwargs=dict(ERNIE_IMAGE_DIT))), seed),
              str(root / "transformer" / "diffusion_pytorch_model.safetensors"))
    _seeded_vae(seed + 1).save_pretrained(str(root / "vae"))
    files = ["transformer/diffusion_pytorch_model*.safetensors", "text_encoder/model.safetensors",
             "vae/diffusion_pytorch_model.safetensors"]
    return {"model_id_with_origin_paths": ",".join(f"{model_id}:{f}" for f in files),
            "tokenizer_path": str(root / "tokenizer")}


# Krea 2's DiT at test size (the class takes its whole configuration as one dict); its text side takes the fixed
# encoder's 2560 features, its 16 latent channels are the VAE's; a head of 16 gives rotary axes of 4, 6 and 6
KREA2_DIT = {"features": 32, "tdim": 16, "txtdim": 2560, "heads": 2, "kvheads": 1, "multiplier": 1, "layers": 2,
             "patch": 2, "channels": 16, "txtheads": 2, "txtkvheads": 1, "txtlayers": 12}
# Krea 2's VAE (diffusers' AutoencoderKLQwenImage, whose keys and sizes DiffSynth's own VAE class takes as they are)
# at test size: 16 latent channels, 8x down
KREA2_VAE = {"base_dim": 32, "z_dim": 16, "dim_mult": [1, 2, 4, 4], "num_res_blocks": 1, "attn_scales": [],
             "temperal_downsample": [False, True, True], "latents_mean": [0.0] * 16, "latents_std": [1.0] * 16}


def _qwen3_vl_4b(outdir: Path, seed: int) -> None:
    """Qwen/Qwen3-VL-4B-Instruct as Krea 2's and LingBot-Video's examples download it: its weights, whose class
    (DiffSynth's Krea2TextEncoder) fixes 4.44 B parameters, its vision tower included: that model with random
    N(0, 0.02) weights in bf16 (8.9 GB, written once a session and linked into each folder), its keys as released
    (`model.language_model.`, `model.visual.`; no `lm_head`, tied to the embeddings, which DiffSynth's converter
    copies); its `config.json` of the release's kind, so the file is recognised by its class; and a test-size Qwen3-VL
    processor (its tokenizer, which Krea 2 reads alone, and image and video processors of the release's patch sizes)
    at the folder's root."""
    from safetensors.torch import save_file

    from .models import skeleton

    folder = outdir / "Qwen" / "Qwen3-VL-4B-Instruct"
    _qwen3_vl_processor(folder)
    (folder / "config.json").write_text(json.dumps({"architectures": ["Qwen3VLForConditionalGeneration"],
                                                    "model_type": "qwen3_vl"}, indent=1) + "\n", encoding="utf-8")
    text = smallest_entry("krea2", "text_encoder", converted=True)

    def released(target: Path) -> None:  # the class's keys back to the release's: its converter's inverse
        weights = _random_weights(skeleton(text), seed)
        save_file({k.replace("model.model.", "model.", 1): v for k, v in weights.items()
                   if k != "model.lm_head.weight"}, str(target))

    _once(folder / "model.safetensors", (text["model_hash"], seed), released)


def _qwen3_vl_processor(folder: Path, chat_template: Optional[str] = None, vision_tokens: bool = False,
                        more_tokens: Optional[dict[str, int]] = None) -> None:
    """A test-size Qwen3-VL processor saved in `folder`: its tokenizer (the test one) with `chat_template` (else the
    tokenizer's own), and image and video processors of the release's patch sizes. With `vision_tokens`, the
    tokenizer has the release's vision tokens at the release's ids (`QWEN_VISION_TOKENS`), which a full-size Qwen-VL
    encoder's configuration fixes: a prompt with a picture then reaches its vision tower; `more_tokens` are added
    so too (HiDream-O1's)."""
    from transformers import Qwen2VLImageProcessor, Qwen3VLProcessor
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = _family_with_slot("AutoencoderKLFlux2").tiny_module().build_tokenizer()
    if vision_tokens:
        tokenizer = _with_vision_tokens(tokenizer, folder, {**QWEN_VISION_TOKENS, **(more_tokens or {})})
    Qwen3VLProcessor(image_processor=Qwen2VLImageProcessor(patch_size=16, merge_size=2, temporal_patch_size=2),
                     tokenizer=tokenizer, video_processor=Qwen3VLVideoProcessor(),
                     chat_template=chat_template or tokenizer.chat_template).save_pretrained(str(folder))


# the vision tokens of Qwen2.5-VL's and Qwen3-VL's releases, at their ids (their encoders' configurations name them:
# image_token_id, vision_start_token_id, ...)
QWEN_VISION_TOKENS = {"<|vision_start|>": 151652, "<|vision_end|>": 151653, "<|vision_pad|>": 151654,
                      "<|image_pad|>": 151655, "<|video_pad|>": 151656}


def _with_vision_tokens(tokenizer: Any, scratch: Path, tokens: Optional[dict[str, int]] = None) -> Any:
    """`tokenizer` (a fast BPE one) with `tokens` (else `QWEN_VISION_TOKENS`) as special tokens at their ids: each put
    in the BPE vocabulary at its id (tokenizers numbers an added token after the vocabulary, whatever id its file
    gives) and marked special. Built through its saved files in `scratch`, which are removed after."""
    import shutil

    from transformers import AutoTokenizer

    where = scratch / ".vision_tokenizer"
    tokenizer.save_pretrained(str(where))
    spec = json.loads((where / "tokenizer.json").read_text(encoding="utf-8"))
    for token, index in (tokens or QWEN_VISION_TOKENS).items():
        spec["model"]["vocab"][token] = index
        spec["added_tokens"].append({"id": index, "content": token, "single_word": False, "lstrip": False,
                                     "rstrip": False, "normalized": False, "special": True})
    (where / "tokenizer.json").write_text(json.dumps(spec), encoding="utf-8")
    try:
        return AutoTokenizer.from_pretrained(str(where))
    finally:
        shutil.rmtree(where, ignore_errors=True)


def _krea2_vae(folder: Path, seed: int) -> None:
    """Krea 2's VAE at test size (`KREA2_VAE`; LingBot-Video's is the same class) as a diffusers folder, its weights
    drawn from `seed`."""
    import torch
    from diffusers import AutoencoderKLQwenImage

    torch.manual_seed(seed)
    AutoencoderKLQwenImage(**KREA2_VAE).save_pretrained(str(folder))


def _krea2(outdir: Path, seed: int) -> dict[str, Any]:
    """Krea 2 as its LoRA example downloads it: krea/Krea-2-Raw's raw.safetensors (the DiT, test-sized,
    `KREA2_DIT`, with its configuration beside it), Qwen/Qwen3-VL-4B-Instruct (`_qwen3_vl_4b`), Qwen-Image's VAE
    (test-sized)."""
    from safetensors.torch import save_file

    from .models import skeleton

    _qwen3_vl_4b(outdir, seed + 2)
    root = outdir / "krea" / "Krea-2-Raw"
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(KREA2_DIT, indent=1) + "\n", encoding="utf-8")
    dit = smallest_entry("krea2", "dit")
    save_file(_random_weights(skeleton(dict(dit, extra_kwargs={"config": dict(KREA2_DIT)})), seed),
              str(root / "raw.safetensors"))
    _krea2_vae(outdir / "Qwen" / "Qwen-Image" / "vae", seed + 1)
    files = ["krea/Krea-2-Raw:raw.safetensors", "Qwen/Qwen3-VL-4B-Instruct:*.safetensors",
             "Qwen/Qwen-Image:vae/diffusion_pytorch_model.safetensors"]
    return {"model_id_with_origin_paths": ",".join(files), "tokenizer_path": "Qwen/Qwen3-VL-4B-Instruct:"}


# LingBot-Video's dense DiT at test size (the class takes every size; its text side takes the fixed encoder's 2560
# features, its 16 latent channels are the VAE's); a head of 16 gives rotary axes of 4, 6 and 6
LINGBOT_VIDEO_DIT = {"hidden_size": 32, "num_attention_heads": 2, "depth": 2, "intermediate_size": 64,
                     "text_dim": 2560, "in_channels": 16, "out_channels": 16, "axes_dims": [4, 6, 6]}


def _lingbot_video(outdir: Path, seed: int) -> dict[str, Any]:
    """LingBot-Video (dense 1.3B, text to video) as its LoRA example downloads it: Robbyant/lingbot-video-dense-1.3b's
    transformer (test-sized, `LINGBOT_VIDEO_DIT`, its configuration beside it) and vae (the Qwen-Image VAE at test
    size, as Krea 2's), and Krea 2's text encoder folder, Qwen/Qwen3-VL-4B-Instruct, whose processor its
    `--processor_path` names (`_qwen3_vl_4b`)."""
    from safetensors.torch import save_file

    from .models import skeleton

    _qwen3_vl_4b(outdir, seed + 2)
    root = outdir / "Robbyant" / "lingbot-video-dense-1.3b"
    (root / "transformer").mkdir(parents=True, exist_ok=True)
    (root / "transformer" / "config.json").write_text(json.dumps(LINGBOT_VIDEO_DIT, indent=1) + "\n",
                                                      encoding="utf-8")
    dit = smallest_entry("lingbot_video", "dit", converted=True)
    save_file(_random_weights(skeleton(dict(dit, extra_kwargs=dict(LINGBOT_VIDEO_DIT))), seed),
              str(root / "transformer" / "diffusion_pytorch_model.safetensors"))
    _krea2_vae(root / "vae", seed + 1)
    model_id = "Robbyant/lingbot-video-dense-1.3b"
    files = [f"{model_id}:transformer/diffusion_pytorch_model.safetensors", "Qwen/Qwen3-VL-4B-Instruct:*.safetensors",
             f"{model_id}:vae/diffusion_pytorch_model.safetensors"]
    return {"model_id_with_origin_paths": ",".join(files), "processor_path": "Qwen/Qwen3-VL-4B-Instruct:"}


# ACE-Step 1.5's turbo file at test size: its DiT (`decoder.`), condition encoder (`encoder.`) and audio tokenizer
# (`tokenizer.`, `detokenizer.`), each class taking every size; the latents have the test VAE's 4 channels (the DiT reads
# them, the context's silence latents and its chunk mask: 12); the lyric side keeps the fixed text encoder's 1024
ACE_STEP_DIT = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
                "num_key_value_heads": 1, "head_dim": 16, "in_channels": 12, "audio_acoustic_hidden_dim": 4,
                "timbre_hidden_dim": 4, "text_hidden_dim": 1024, "num_lyric_encoder_hidden_layers": 1,
                "num_timbre_encoder_hidden_layers": 1, "num_attention_pooler_hidden_layers": 1,
                "num_audio_decoder_hidden_layers": 1, "fsq_dim": 32}
# its VAE (diffusers' AutoencoderOobleck, whose configuration names DiffSynth's class takes as they are) at test size:
# the release's 1920x down at 48 kHz (the pipeline's units assume it), 4 latent channels (half the encoder's 8)
ACE_STEP_VAE = {"_class_name": "AutoencoderOobleck", "encoder_hidden_size": 8, "downsampling_ratios": [2, 4, 4, 6, 10],
                "channel_multiples": [1, 1, 1, 1, 1], "decoder_channels": 8, "decoder_input_channels": 4,
                "audio_channels": 2, "sampling_rate": 48000}
ACE_STEP_SILENCE_FRAMES = 800  # the release's is longer; its units take the first 750 (a 30 s reference) or a song's


def _ace_step(outdir: Path, seed: int) -> dict[str, Any]:
    """ACE-Step 1.5 as its LoRA example downloads it (ACE-Step/Ace-Step1.5's acestep-v15-turbo/model.safetensors,
    Qwen3-Embedding-0.6B/ and vae/), each file in the release's layout: the turbo file holds three test-size models
    (`ACE_STEP_DIT`, with its configuration beside it); the text encoder's class fixes Qwen3-Embedding's 0.6 B
    parameters, so it is that model with random N(0, 0.02) weights in bf16 (1.2 GB, written once a session), its
    keys without the class's `model.`; the VAE is test-sized (`ACE_STEP_VAE`); the tokenizer a test-size Qwen one in
    the encoder's folder, where its train.py looks by default. The silence latent, which the release keeps as a
    `.pt` pickle, is written as the safetensors twin unitgraph reads (models.tensor_file): a random (1, 4, 800)
    tensor."""
    import torch
    from diffsynth.models.ace_step_vae import AceStepVAE
    from safetensors.torch import save_file

    from .models import skeleton

    model_id = "ACE-Step/Ace-Step1.5"
    root = outdir / model_id
    turbo = root / "acestep-v15-turbo"
    turbo.mkdir(parents=True, exist_ok=True)
    (turbo / "config.json").write_text(json.dumps(ACE_STEP_DIT, indent=1) + "\n", encoding="utf-8")
    weights: dict[str, Any] = {}
    for offset, (attribute, prefix) in enumerate((("dit", "decoder."), ("conditioner", "encoder."),
                                                  ("tokenizer_model", ""))):
        entry = smallest_entry("ace_step", attribute, converted=True)
        weights.update(_random_weights(skeleton(dict(entry, extra_kwargs=dict(ACE_STEP_DIT))), seed + 4 * offset, prefix))
    weights["null_condition_emb"] = weights.pop("encoder.null_condition_emb")  # the release keeps it at the top
    save_file(weights, str(turbo / "model.safetensors"))
    generator = torch.Generator().manual_seed(seed + 3)
    silence = torch.randn(1, ACE_STEP_VAE["decoder_input_channels"], ACE_STEP_SILENCE_FRAMES, generator=generator)
    save_file({"silence_latent": silence.to(torch.bfloat16)}, str(turbo / "silence_latent.safetensors"))
    text = root / "Qwen3-Embedding-0.6B"
    _family_with_slot("AutoencoderKLFlux2").tiny_module().build_tokenizer().save_pretrained(str(text))
    (text / "config.json").write_text(json.dumps({"architectures": ["Qwen3Model"], "model_type": "qwen3",
                                                  "hidden_size": 1024}, indent=1) + "\n", encoding="utf-8")
    encoder = smallest_entry("ace_step", "text_encoder", converted=True)
    _once(text / "model.safetensors", (encoder["model_hash"], seed + 2), lambda target: save_file(
        {k.removeprefix("model."): v for k, v in _random_weights(skeleton(encoder), seed + 2).items()}, str(target)))
    (root / "vae").mkdir(parents=True, exist_ok=True)
    (root / "vae" / "config.json").write_text(json.dumps(ACE_STEP_VAE, indent=1) + "\n", encoding="utf-8")
    torch.manual_seed(seed + 1)
    vae = AceStepVAE(**{k: v for k, v in ACE_STEP_VAE.items() if not k.startswith("_")})
    save_file({k: v.contiguous() for k, v in vae.state_dict().items()},
              str(root / "vae" / "diffusion_pytorch_model.safetensors"))
    files = ["acestep-v15-turbo/model.safetensors", "Qwen3-Embedding-0.6B/model.safetensors",
             "vae/diffusion_pytorch_model.safetensors"]
    return {"model_id_with_origin_paths": ",".join(f"{model_id}:{f}" for f in files),
            "tokenizer_path": f"{model_id}:Qwen3-Embedding-0.6B/",
            "silence_latent_path": f"{model_id}:acestep-v15-turbo/silence_latent.pt"}


# Boogu-Image's DiT at test size: a head of 120 (its rotary unit fixes axes of 40, 40 and 40), one block of each kind;
# its instruction side takes the fixed encoder's 4096 features (the class's default)
BOOGU_IMAGE_DIT = {"hidden_size": 240, "num_layers": 2, "num_double_stream_layers": 1, "num_refiner_layers": 1,
                   "num_attention_heads": 2, "num_kv_heads": 1, "multiple_of": 16}


def released_qwen3_vl_key(key: str) -> str:
    """A key of DiffSynth's Qwen3-VL 8B text encoder class under the release's name (its converter's inverse)."""
    if key == "model.lm_head.weight":
        return "lm_head.weight"
    return "model." + key[len("model.model."):] if key.startswith("model.model.") else key


def _boogu_image(outdir: Path, seed: int) -> dict[str, Any]:
    """Boogu-Image 0.1 Base as its LoRA example downloads it: its mllm/ folder (the text encoder, whose class fixes
    Qwen3-VL 8B's 8.77 B parameters, written as released: random bf16 weights in four shards, 17.5 GB once a session,
    which DiffSynth's table knows by the release's key hash; and a test-size Qwen3-VL processor, which its train.py
    reads from the same folder), its transformer (test-sized, `BOOGU_IMAGE_DIT`, its configuration beside it) and
    its 16-channel VAE at the size the release fixes (84 M parameters, known by its key hash)."""
    import torch
    from diffsynth.models.boogu_image_dit import BooguImageDiT
    from safetensors.torch import save_file

    from ..models.diffsynth_layout import write_released_vae

    model_id = "Boogu/Boogu-Image-0.1-Base"
    root = outdir / model_id
    _qwen3_vl_processor(root / "mllm", QWEN3_VL_TEXT_TEMPLATE)
    write_released_shards(root / "mllm", "boogu_image", "text_encoder", seed + 2, released_qwen3_vl_key, shards=4)
    torch.manual_seed(seed)
    dit = BooguImageDiT(**BOOGU_IMAGE_DIT)
    with torch.no_grad():  # its output layers start at zero, which would leave every LoRA of a first step without a
        for param in dit.parameters():  # gradient: drawn as the other weights are
            if not param.any():
                param.normal_(0.0, 0.02)
    (root / "transformer").mkdir(parents=True, exist_ok=True)
    (root / "transformer" / "config.json").write_text(json.dumps(BOOGU_IMAGE_DIT, indent=1) + "\n", encoding="utf-8")
    save_file({k: v.to(torch.bfloat16).contiguous() for k, v in dit.state_dict().items()},
              str(root / "transformer" / "diffusion_pytorch_model.safetensors"))
    write_released_vae(root / "vae", seed + 1)
    files = ["transformer/*.safetensors", "mllm/*.safetensors", "vae/*.safetensors"]
    return {"model_id_with_origin_paths": ",".join(f"{model_id}:{f}" for f in files)}


# JoyAI-Image's DiT at test size: two double-stream blocks 64 wide (a head of 32, its rotary axes 8, 12 and 12); its
# text side takes the fixed encoder's 4096 features, its picture side the VAE's 16 latent channels
JOYAI_IMAGE_DIT = {"hidden_size": 64, "heads_num": 2, "mm_double_blocks_depth": 2, "rope_dim_list": [8, 12, 12],
                   "text_states_dim": 4096, "in_channels": 16, "out_channels": 16}


def _joyai_image(outdir: Path, seed: int) -> dict[str, Any]:
    """JoyAI-Image-Edit as its LoRA example downloads it: its JoyAI-Image-Und/ folder (Boogu-Image's Qwen3-VL 8B
    encoder, as released in four shards, and a test-size Qwen3-VL processor with the release's vision tokens), its
    transformer/transformer.pth (the DiT, test-sized: `JOYAI_IMAGE_DIT`, its configuration beside it) and its
    vae/*.pth (the VAE of DiffSynth's table, whose class fixes its 127 M parameters, in the release's keys), both
    `torch.save` pickles as released, each with the safetensors twin `unitgraph twin` writes beside it
    (models/twin.py)."""
    import torch
    from diffsynth.models.joyai_image_dit import JoyAIImageDiT
    from safetensors.torch import save_file

    from .models import skeleton

    model_id = "jd-opensource/JoyAI-Image-Edit"
    root = outdir / model_id
    _qwen3_vl_processor(root / "JoyAI-Image-Und", vision_tokens=True)
    write_released_shards(root / "JoyAI-Image-Und", "joyai_image", "text_encoder", seed + 2, released_qwen3_vl_key,
                          shards=4)
    torch.manual_seed(seed)
    dit = {k: v.to(torch.bfloat16).contiguous() for k, v in JoyAIImageDiT(**JOYAI_IMAGE_DIT).state_dict().items()}
    vae = _random_weights(skeleton(smallest_entry("joyai_image", "vae", converted=True)), seed + 1)
    vae = {k.removeprefix("model."): v for k, v in vae.items()}  # the release's keys: its converter's inverse
    vae_file = "vae/Wan2.1_VAE.pth"
    for file, weights in (("transformer/transformer.pth", dit), (vae_file, vae)):
        (root / file).parent.mkdir(parents=True, exist_ok=True)
        torch.save(weights, str(root / file))
        save_file(weights, str((root / file).with_suffix(".safetensors")), metadata={"format": "pt"})
    (root / "transformer" / "config.json").write_text(json.dumps(JOYAI_IMAGE_DIT, indent=1) + "\n", encoding="utf-8")
    files = ["JoyAI-Image-Und/model*.safetensors", vae_file, "transformer/transformer.pth"]
    return {"model_id_with_origin_paths": ",".join(f"{model_id}:{f}" for f in files)}


# the special tokens HiDream-O1's tokenizer adds after Qwen3-VL's, at the release's ids: its prompt unit frames a
# prompt with the image's (boi) and the timestep's (tms) tokens, and its DiT puts the timestep's embedding where the
# tms token's id (151673, fixed in its class) is
HIDREAM_TOKENS = {"<|boi_token|>": 151669, "<|bor_token|>": 151670, "<|eor_token|>": 151671, "<|bot_token|>": 151672,
                  "<|tms_token|>": 151673}


def _hidream_o1_image(outdir: Path, seed: int) -> dict[str, Any]:
    """HiDream-O1-Image-Dev as its LoRA example downloads it: its DiT (a Qwen3-VL 8B whose class fixes its 8.80 B
    parameters), written as released: random bf16 weights in four shards `model-0000i-of-00004.safetensors` at the
    release's root (17.6 GB once a session), which DiffSynth's table knows by their key hash; and beside them, where
    its train.py's --processor_config looks by default (`./`), a test-size Qwen3-VL processor whose tokenizer has the
    release's vision tokens and HiDream's own (`HIDREAM_TOKENS`) at their ids."""
    model_id = "HiDream-ai/HiDream-O1-Image-Dev"
    root = outdir / model_id
    _qwen3_vl_processor(root, vision_tokens=True, more_tokens=HIDREAM_TOKENS)
    write_released_shards(root, "hidream_o1_image", "dit", seed, lambda key: key, shards=4)  # its own keys
    return {"model_id_with_origin_paths": f"{model_id}:model-*.safetensors"}


def _seeded_vae(seed: int) -> Any:
    """The VAE (diffusers' AutoencoderKLFlux2) of the tests' Ideogram 4 and ERNIE-Image (`IDEOGRAM4_VAE`), its
    weights drawn from `seed`."""
    import torch
    from diffusers import AutoencoderKLFlux2

    torch.manual_seed(seed)
    return AutoencoderKLFlux2(**IDEOGRAM4_VAE)


# writers of DiffSynth's pipelines of no family
OWN = {"ideogram4": _ideogram4, "anima_image": _anima, "ernie_image": _ernie_image, "krea2": _krea2,
       "lingbot_video": _lingbot_video, "ace_step": _ace_step, "boogu_image": _boogu_image,
       "joyai_image": _joyai_image, "hidream_o1_image": _hidream_o1_image}


def writers() -> dict[str, Any]:
    """{DiffSynth pipeline module: writer(outdir, seed) of its test-size models}: the families' and this module's."""
    from functools import partial

    from .glue import family_modules

    found: dict[str, Any] = {}
    for module in family_modules():
        for glue in module.PIPELINES:
            writer = module.write_diffsynth_models
            # a family's folder may not import this package (the rooms of CONTRIBUTING.md): a writer that needs a
            # model at the smallest size DiffSynth's table allows (in one file, or in a release's shards) is handed
            # the function that writes it
            taken = inspect.signature(writer).parameters
            tools = {k: v for k, v in (("write_smallest", write_smallest_model),
                                       ("write_released", write_released_shards)) if k in taken}
            found[glue.module] = partial(writer, module=glue.module, **tools)
    return {**found, **OWN}


def write_tiny_models(outdir: "str | Path", module: str, seed: int = 0) -> dict[str, Any]:
    """Write the tiny `./models` of DiffSynth's pipeline `module` under `outdir`; return the flags that name them
    (`model_id_with_origin_paths`, relative to `outdir` as DiffSynth's base folder, and `tokenizer_path`)."""
    known = writers()
    if module not in known:
        raise BackendError(f"no test-sized models of diffsynth:{module} (written: {', '.join(known)})")
    out = Path(outdir)
    out.mkdir(parents=True, exist_ok=True)
    flags = known[module](outdir=out, seed=seed)
    (out / "unitgraph_tiny.json").write_text(json.dumps({"pipeline": f"diffsynth:{module}", "seed": seed, **flags},
                                                        indent=1) + "\n", encoding="utf-8")
    return flags
