"""What the Qwen-Image units do (their declarations are in `registry.py`).

Each implementation is `fn(ctx, **inputs) -> {output: value}` over one sample (batch dimension 1).
`ctx.models` holds the loaded components by slot ("vae", "text_encoder", "tokenizer", "dit",
"scheduler"); a unit only touches the models it declares, so a stage that did not load a model can
never run a unit that needs it. Non-deterministic units draw only from `ctx.rng(purpose)`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from .args import BackendError
from .randomness import generator

# diffusers' QwenImagePipeline prompt template and the number of leading template tokens it drops.
PROMPT_TEMPLATE = (
    "<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, text, "
    "spatial relationships of the objects and background:<|im_end|>\n<|im_start|>user\n{}<|im_end|>\n"
    "<|im_start|>assistant\n"
)
PROMPT_TEMPLATE_DROP = 34
TOKENIZER_MAX_LENGTH = 1024
MAX_SEQUENCE_LENGTH = 512
MULTIPLE = 16  # image sides are multiples of this (VAE factor x 2x2 patches)


@dataclass
class ImageSize:
    height: Optional[int] = None
    width: Optional[int] = None
    max_pixels: int = 1024 * 1024


@dataclass
class UnitContext:
    """What a unit may use: loaded models, settings, and randomness for (seed, epoch, sample)."""

    models: dict[str, Any]
    size: ImageSize = field(default_factory=ImageSize)
    device: Any = "cpu"
    dtype: Any = torch.float32
    seed: int = 0
    epoch: Optional[int] = None
    sample_key: Optional[str] = None
    timestep_bounds: tuple[float, float] = (0.0, 1.0)
    _sigma_cache: dict = field(default_factory=dict)

    def model(self, slot: str) -> Any:
        if slot not in self.models:
            raise RuntimeError(f"model {slot!r} is not loaded in this stage")
        return self.models[slot]

    def raw(self, slot: str) -> Any:
        """The model itself, unwrapped from DDP (for its config and attributes)."""
        model = self.model(slot)
        return getattr(model, "module", model)

    def rng(self, purpose: str) -> torch.Generator:
        if self.epoch is None or self.sample_key is None:
            raise RuntimeError(f"a deterministic stage drew randomness ({purpose}); the unit must be declared non-deterministic")
        return generator(self.seed, "sample", self.epoch, self.sample_key, purpose)

    def tensor(self, value: Any) -> Any:
        return value.to(self.device) if isinstance(value, torch.Tensor) else value


# ------------------------------------------------------------------------------------------------
# shapes


def target_size(width: int, height: int, size: ImageSize) -> tuple[int, int]:
    """(width, height) an image of this size is resized to: fixed, or scaled under max_pixels, multiples of 16."""
    if size.height is not None and size.width is not None:
        return size.width, size.height
    scale = min(1.0, math.sqrt(size.max_pixels / float(width * height)))
    w = max(MULTIPLE, int(width * scale) // MULTIPLE * MULTIPLE)
    h = max(MULTIPLE, int(height * scale) // MULTIPLE * MULTIPLE)
    return w, h


def image_to_tensor(image: Any, size: ImageSize, dtype: Any) -> torch.Tensor:
    """Resize (cover, then centre crop) and convert a PIL image to (1, 3, 1, H, W) in [-1, 1]."""
    import numpy as np
    from PIL import Image

    if isinstance(image, list):
        if len(image) != 1:
            raise BackendError(f"expected one image per sample, got {len(image)}")
        image = image[0]
    if not isinstance(image, Image.Image):
        raise BackendError(f"expected an image, got {type(image).__name__}")
    w0, h0 = image.size
    w, h = target_size(w0, h0, size)
    scale = max(w / w0, h / h0)
    rw, rh = max(w, round(w0 * scale)), max(h, round(h0 * scale))
    image = image.convert("RGB").resize((rw, rh), Image.Resampling.BICUBIC)
    left, top = (rw - w) // 2, (rh - h) // 2
    image = image.crop((left, top, left + w, top + h))
    array = torch.from_numpy(np.asarray(image, dtype=np.float32).copy())  # H, W, 3
    pixels = array.permute(2, 0, 1) / 127.5 - 1.0
    return pixels[None, :, None].to(dtype)


def shape_checker(ctx: UnitContext, image: Any, edit_image: Any) -> dict[str, Any]:
    if image is None:
        raise BackendError("sample has no image")
    pixels = image_to_tensor(image, ctx.size, ctx.dtype)
    edit = None if edit_image is None else image_to_tensor(edit_image, ctx.size, ctx.dtype)
    return {"image": pixels, "edit_image": edit, "height": int(pixels.shape[-2]), "width": int(pixels.shape[-1])}


# ------------------------------------------------------------------------------------------------
# VAE


def _vae_stats(vae: Any, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    z = vae.config.z_dim
    mean = torch.tensor(vae.config.latents_mean, dtype=like.dtype, device=like.device).view(1, z, 1, 1, 1)
    std = torch.tensor(vae.config.latents_std, dtype=like.dtype, device=like.device).view(1, z, 1, 1, 1)
    return mean, std


def encode_distribution(ctx: UnitContext, pixels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The VAE posterior of an image, in normalised latent space: (mean, logvar), each (1, z, 1, h, w)."""
    vae = ctx.model("vae")
    raw = ctx.raw("vae")
    posterior = vae.encode(ctx.tensor(pixels).to(raw.dtype)).latent_dist
    shift, scale = _vae_stats(raw, posterior.mean)
    mean = (posterior.mean - shift) / scale
    logvar = posterior.logvar - 2.0 * torch.log(scale)
    return mean, logvar


def image_encoder(ctx: UnitContext, image: torch.Tensor) -> dict[str, Any]:
    mean, logvar = encode_distribution(ctx, image)
    return {"latent_mean": mean, "latent_logvar": logvar}


def edit_image_encoder(ctx: UnitContext, edit_image: Any) -> dict[str, Any]:
    if edit_image is None:
        return {"edit_latents": None}
    mean, _ = encode_distribution(ctx, edit_image)
    return {"edit_latents": mean}


def latent_sampler(ctx: UnitContext, latent_mean: torch.Tensor, latent_logvar: torch.Tensor) -> dict[str, Any]:
    eps = torch.randn(latent_mean.shape, generator=ctx.rng("latent"), dtype=latent_mean.dtype)
    mean, logvar = ctx.tensor(latent_mean), ctx.tensor(latent_logvar)
    return {"input_latents": mean + torch.exp(0.5 * logvar) * eps.to(mean.device)}


def target_latents(ctx: UnitContext, latent_mean: torch.Tensor) -> dict[str, Any]:
    return {"input_latents": latent_mean}


# ------------------------------------------------------------------------------------------------
# text


def encode_prompts(ctx: UnitContext, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen-Image prompt embeddings: the template's system prefix is encoded, then dropped."""
    tokenizer = ctx.model("tokenizer")
    text_encoder = ctx.model("text_encoder")
    texts = [PROMPT_TEMPLATE.format(p) for p in prompts]
    tokens = tokenizer(texts, max_length=TOKENIZER_MAX_LENGTH + PROMPT_TEMPLATE_DROP, padding=True,
                       truncation=True, return_tensors="pt")
    ids, mask = tokens.input_ids.to(ctx.device), tokens.attention_mask.to(ctx.device)
    out = text_encoder(input_ids=ids, attention_mask=mask, output_hidden_states=True)
    hidden = out.hidden_states[-1]
    pieces = [h[m.bool()][PROMPT_TEMPLATE_DROP:][:MAX_SEQUENCE_LENGTH] for h, m in zip(hidden, mask)]
    if any(p.shape[0] == 0 for p in pieces):
        raise BackendError("the tokenizer does not match the Qwen-Image prompt template (no prompt tokens left after the template)")
    length = max(p.shape[0] for p in pieces)
    emb = torch.stack([torch.cat([p, p.new_zeros(length - p.shape[0], p.shape[1])]) for p in pieces])
    emb_mask = torch.stack([torch.cat([torch.ones(p.shape[0], dtype=torch.long, device=p.device),
                                       torch.zeros(length - p.shape[0], dtype=torch.long, device=p.device)])
                            for p in pieces])
    return emb.to(ctx.dtype), emb_mask


def prompt_encoder(ctx: UnitContext, prompt: Any) -> dict[str, Any]:
    if not isinstance(prompt, str):
        raise BackendError(f"prompt must be a string, got {type(prompt).__name__}")
    emb, mask = encode_prompts(ctx, [prompt])
    return {"prompt_emb": emb, "prompt_emb_mask": mask}


def negative_prompt_encoder(ctx: UnitContext, negative_prompt: Any, cfg_scale: Any) -> dict[str, Any]:
    if cfg_scale is None or float(cfg_scale) <= 1.0:
        return {"negative_prompt_emb": None, "negative_prompt_emb_mask": None}
    emb, mask = encode_prompts(ctx, [negative_prompt if isinstance(negative_prompt, str) and negative_prompt else " "])
    return {"negative_prompt_emb": emb, "negative_prompt_emb_mask": mask}


# ------------------------------------------------------------------------------------------------
# noise, packing, timesteps


def noise_initializer(ctx: UnitContext, input_latents: torch.Tensor) -> dict[str, Any]:
    noise = torch.randn(input_latents.shape, generator=ctx.rng("noise"), dtype=input_latents.dtype)
    return {"noise": noise.to(input_latents.device)}


def seeded_noise(ctx: UnitContext, input_latents: torch.Tensor, seed: Any) -> dict[str, Any]:
    if seed is None:
        raise BackendError("direct_distill needs a 'seed' column in the metadata (and --extra_inputs seed,...)")
    gen = torch.Generator(device="cpu")
    gen.manual_seed(int(seed))
    noise = torch.randn(input_latents.shape, generator=gen, dtype=input_latents.dtype)
    return {"noise": noise.to(input_latents.device)}


def pack(latents: torch.Tensor) -> torch.Tensor:
    """(B, C, 1, h, w) -> (B, h/2 * w/2, 4C): 2x2 patches, as the Qwen-Image transformer reads them."""
    b, c, t, h, w = latents.shape
    if t != 1 or h % 2 or w % 2:
        raise BackendError(f"cannot pack latents of shape {tuple(latents.shape)} (need 1 frame, even sides)")
    x = latents.reshape(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5)
    return x.reshape(b, (h // 2) * (w // 2), c * 4)


def latent_packer(ctx: UnitContext, input_latents: torch.Tensor, noise: torch.Tensor, edit_latents: Any) -> dict[str, Any]:
    shapes = [(1, int(input_latents.shape[-2]) // 2, int(input_latents.shape[-1]) // 2)]
    packed_edit = None
    if edit_latents is not None:
        shapes.append((1, int(edit_latents.shape[-2]) // 2, int(edit_latents.shape[-1]) // 2))
        packed_edit = pack(ctx.tensor(edit_latents))
    return {"input_latents": pack(input_latents), "noise": pack(noise), "edit_latents": packed_edit,
            "img_shapes": [shapes]}


def calculate_shift(seq_len: int, config: Any) -> float:
    base_len = config.get("base_image_seq_len", 256)
    max_len = config.get("max_image_seq_len", 4096)
    base_shift = config.get("base_shift", 0.5)
    max_shift = config.get("max_shift", 1.15)
    slope = (max_shift - base_shift) / (max_len - base_len)
    return seq_len * slope + base_shift - slope * base_len


def schedule_sigmas(ctx: UnitContext, seq_len: int, num_steps: int, inference: bool = False) -> torch.Tensor:
    """The scheduler's sigmas for an image of `seq_len` tokens (num_steps + 1 values, ending at 0)."""
    import copy

    import numpy as np

    key = (seq_len, num_steps, inference)
    if key not in ctx._sigma_cache:
        scheduler = copy.deepcopy(ctx.model("scheduler"))
        mu = calculate_shift(seq_len, scheduler.config)
        kwargs = {"mu": mu} if scheduler.config.get("use_dynamic_shifting", False) else {}
        if inference:
            scheduler.set_timesteps(sigmas=np.linspace(1.0, 1.0 / num_steps, num_steps).tolist(), device="cpu", **kwargs)
        else:
            scheduler.set_timesteps(num_steps, device="cpu", **kwargs)
        ctx._sigma_cache[key] = scheduler.sigmas.detach().to(torch.float32).clone()
    return ctx._sigma_cache[key]


def timestep_sampler(ctx: UnitContext, img_shapes: Any) -> dict[str, Any]:
    _, h, w = img_shapes[0][0]
    steps = int(ctx.model("scheduler").config.get("num_train_timesteps", 1000))
    sigmas = schedule_sigmas(ctx, int(h * w), steps)[:steps]
    lo, hi = ctx.timestep_bounds
    # sigmas fall from ~1 to ~0: index 0 is the noisiest; the bounds are fractions of the noise level
    first = int(round((1.0 - hi) * steps))
    last = max(first + 1, int(round((1.0 - lo) * steps)))
    index = int(torch.randint(first, last, (1,), generator=ctx.rng("timestep")).item())
    return {"timestep": (sigmas[index] * 1000.0).reshape(1).to(ctx.device)}


UNITS: dict[str, Callable[..., dict[str, Any]]] = {
    "ShapeChecker": shape_checker,
    "ImageEncoder": image_encoder,
    "EditImageEncoder": edit_image_encoder,
    "PromptEncoder": prompt_encoder,
    "NegativePromptEncoder": negative_prompt_encoder,
    "LatentSampler": latent_sampler,
    "TargetLatents": target_latents,
    "NoiseInitializer": noise_initializer,
    "SeededNoise": seeded_noise,
    "LatentPacker": latent_packer,
    "TimestepSampler": timestep_sampler,
}


def run_unit(unit: Any, ctx: UnitContext, inputs: dict[str, Any]) -> dict[str, Any]:
    """Call a declared unit's implementation and check it wrote exactly its declared outputs."""
    fn = UNITS[unit.name]
    out = fn(ctx, **{p: inputs[p] for p in unit.inputs})
    if set(out) != set(unit.outputs):
        raise RuntimeError(f"unit {unit.name} wrote {sorted(out)}, declared {sorted(unit.outputs)}")
    return out
