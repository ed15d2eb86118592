"""Qwen-Image's units: each declaration right above the code that runs it.

Params of the Qwen-Image pipelines (one sample; tensors carry a batch dimension of 1):

  dataset    image (PIL), prompt (str), edit_image (PIL or None: only with --extra_inputs edit_image)
  shape      image/edit_image become float tensors (1, 3, 1, H, W) in [-1, 1]; height, width (ints)
  vae        latent_mean, latent_logvar: the VAE posterior of the image (cached, not a sample)
             edit_latents: normalised mean latents of the edit image (None without one)
  text       prompt_emb (1, L, D), prompt_emb_mask (1, L): template tokens dropped
  fresh      input_latents: a sample of the posterior, normalised; noise; timestep (non-deterministic)
  packed     input_latents/noise/edit_latents packed into 2x2 patches, img_shapes for RoPE

Each function is `fn(ctx, **inputs) -> {output: value}` over one sample; it touches only the models
it declares, and a non-deterministic unit draws only from `ctx.rng(purpose)`. torch is imported on
first use, so `unitgraph plan diffusion:qwen_image` reads these declarations without it.
"""

from __future__ import annotations

from typing import Any

from ...args import BackendError
from ...family import lazy_module, unit

torch = lazy_module("torch")

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

# ------------------------------------------------------------------------------------------------
# shapes


def image_to_tensor(image: Any, size: Any, dtype: Any) -> torch.Tensor:
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
    w, h = size.target(w0, h0, MULTIPLE)
    scale = max(w / w0, h / h0)
    rw, rh = max(w, round(w0 * scale)), max(h, round(h0 * scale))
    if rw * rh > 4 * w * h:
        # an extreme aspect ratio: resizing to cover first would make a huge image (a 10000x16 strip
        # covering 1024x1024 is 640000 px wide); crop the source to the target's aspect first instead
        if w0 / h0 > w / h:
            cw, ch = max(1, round(h0 * w / h)), h0
        else:
            cw, ch = w0, max(1, round(w0 * h / w))
        left, top = (w0 - cw) // 2, (h0 - ch) // 2
        image = image.crop((left, top, left + cw, top + ch))
        w0, h0 = image.size
        scale = max(w / w0, h / h0)
        rw, rh = max(w, round(w0 * scale)), max(h, round(h0 * scale))
    image = image.convert("RGB").resize((rw, rh), Image.Resampling.BICUBIC)
    left, top = (rw - w) // 2, (rh - h) // 2
    image = image.crop((left, top, left + w, top + h))
    array = torch.from_numpy(np.asarray(image, dtype=np.float32).copy())  # H, W, 3
    pixels = array.permute(2, 0, 1) / 127.5 - 1.0
    return pixels[None, :, None].to(dtype)


@unit("ShapeChecker", inputs=("image", "edit_image"), outputs=("image", "edit_image", "height", "width"),
      settings=("image_size", "dtype", "cache_dtype"))
def shape_checker(ctx, image: Any, edit_image: Any) -> dict[str, Any]:
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


def encode_distribution(ctx, pixels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The VAE posterior of an image, in normalised latent space: (mean, logvar), each (1, z, 1, h, w)."""
    vae = ctx.model("vae")
    raw = ctx.raw("vae")
    posterior = vae.encode(ctx.tensor(pixels).to(raw.dtype)).latent_dist
    shift, scale = _vae_stats(raw, posterior.mean)
    mean = (posterior.mean - shift) / scale
    logvar = posterior.logvar - 2.0 * torch.log(scale)
    return mean, logvar


@unit("ImageEncoder", inputs=("image",), outputs=("latent_mean", "latent_logvar"), models=("vae",),
      settings=("dtype", "cache_dtype"))
def image_encoder(ctx, image: torch.Tensor) -> dict[str, Any]:
    mean, logvar = encode_distribution(ctx, image)
    return {"latent_mean": mean, "latent_logvar": logvar}


@unit("EditImageEncoder", inputs=("edit_image",), outputs=("edit_latents",), models=("vae",),
      settings=("dtype", "cache_dtype"))
def edit_image_encoder(ctx, edit_image: Any) -> dict[str, Any]:
    if edit_image is None:
        return {"edit_latents": None}
    mean, _ = encode_distribution(ctx, edit_image)
    return {"edit_latents": mean}


# honest VAE sampling: the cache keeps the posterior, training draws a fresh latent each epoch
@unit("LatentSampler", inputs=("latent_mean", "latent_logvar"), outputs=("input_latents",), deterministic=False,
      settings=("seed", "cache_dtype"))
def latent_sampler(ctx, latent_mean: torch.Tensor, latent_logvar: torch.Tensor) -> dict[str, Any]:
    eps = torch.randn(latent_mean.shape, generator=ctx.rng("latent"), dtype=latent_mean.dtype)
    mean, logvar = ctx.tensor(latent_mean), ctx.tensor(latent_logvar)
    return {"input_latents": mean + torch.exp(0.5 * logvar) * eps.to(mean.device)}


@unit("TargetLatents", inputs=("latent_mean",), outputs=("input_latents",), settings=("cache_dtype",))
def target_latents(ctx, latent_mean: torch.Tensor) -> dict[str, Any]:
    return {"input_latents": latent_mean}


# ------------------------------------------------------------------------------------------------
# text


def encode_prompts(ctx, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
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


@unit("PromptEncoder", inputs=("prompt",), outputs=("prompt_emb", "prompt_emb_mask"), models=("text_encoder",),
      settings=("dtype", "cache_dtype"))
def prompt_encoder(ctx, prompt: Any) -> dict[str, Any]:
    if not isinstance(prompt, str):
        raise BackendError(f"prompt must be a string, got {type(prompt).__name__}")
    emb, mask = encode_prompts(ctx, [prompt])
    return {"prompt_emb": emb, "prompt_emb_mask": mask}


@unit("NegativePromptEncoder", inputs=("negative_prompt", "cfg_scale"),
      outputs=("negative_prompt_emb", "negative_prompt_emb_mask"), models=("text_encoder",), settings=("dtype", "cache_dtype"))
def negative_prompt_encoder(ctx, negative_prompt: Any, cfg_scale: Any) -> dict[str, Any]:
    if cfg_scale is None or float(cfg_scale) <= 1.0:
        return {"negative_prompt_emb": None, "negative_prompt_emb_mask": None}
    emb, mask = encode_prompts(ctx, [negative_prompt if isinstance(negative_prompt, str) and negative_prompt else " "])
    return {"negative_prompt_emb": emb, "negative_prompt_emb_mask": mask}


# ------------------------------------------------------------------------------------------------
# noise, packing, timesteps


@unit("NoiseInitializer", inputs=("input_latents",), outputs=("noise",), deterministic=False,
      settings=("seed", "cache_dtype"))
def noise_initializer(ctx, input_latents: torch.Tensor) -> dict[str, Any]:
    noise = torch.randn(input_latents.shape, generator=ctx.rng("noise"), dtype=input_latents.dtype)
    return {"noise": noise.to(input_latents.device)}


@unit("SeededNoise", inputs=("input_latents", "seed"), outputs=("noise",), settings=("cache_dtype",))
def seeded_noise(ctx, input_latents: torch.Tensor, seed: Any) -> dict[str, Any]:
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


@unit("LatentPacker", inputs=("input_latents", "noise", "edit_latents"),
      outputs=("input_latents", "noise", "edit_latents", "img_shapes"), settings=("cache_dtype",))
def latent_packer(ctx, input_latents: torch.Tensor, noise: torch.Tensor, edit_latents: Any) -> dict[str, Any]:
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


def schedule_sigmas(ctx, seq_len: int, num_steps: int, inference: bool = False) -> torch.Tensor:
    """The scheduler's sigmas for an image of `seq_len` tokens (num_steps + 1 values, ending at 0)."""
    import copy

    import numpy as np

    key = (seq_len, num_steps, inference)
    if key not in ctx.memo:
        scheduler = copy.deepcopy(ctx.model("scheduler"))
        mu = calculate_shift(seq_len, scheduler.config)
        kwargs = {"mu": mu} if scheduler.config.get("use_dynamic_shifting", False) else {}
        if inference:
            scheduler.set_timesteps(sigmas=np.linspace(1.0, 1.0 / num_steps, num_steps).tolist(), device="cpu", **kwargs)
        else:
            scheduler.set_timesteps(num_steps, device="cpu", **kwargs)
        ctx.memo[key] = scheduler.sigmas.detach().to(torch.float32).clone()
    return ctx.memo[key]


@unit("TimestepSampler", inputs=("img_shapes",), outputs=("timestep",), deterministic=False,
      settings=("seed", "timestep_bounds", "cache_dtype"))
def timestep_sampler(ctx, img_shapes: Any) -> dict[str, Any]:
    _, h, w = img_shapes[0][0]
    steps = int(ctx.model("scheduler").config.get("num_train_timesteps", 1000))
    sigmas = schedule_sigmas(ctx, int(h * w), steps)[:steps]
    lo, hi = ctx.timestep_bounds
    # sigmas fall from ~1 to ~0: index 0 is the noisiest; the bounds are fractions of the noise level
    first = int(round((1.0 - hi) * steps))
    last = max(first + 1, int(round((1.0 - lo) * steps)))
    index = int(torch.randint(first, last, (1,), generator=ctx.rng("timestep")).item())
    return {"timestep": (sigmas[index] * 1000.0).reshape(1).to(ctx.device)}


