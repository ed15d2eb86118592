"""Qwen-Image's units: each declaration right above the code that runs it.

Params of the Qwen-Image pipelines (one sample; tensors carry a batch dimension of 1):

  dataset    image (PIL), prompt (str), edit_image (PIL or None: only with --extra_inputs edit_image;
             in the edit pipelines a PIL image, or for qwen_image_edit_plus a list of them)
  shape      image/edit_image become float tensors (1, 3, 1, H, W) in [-1, 1]; height, width (ints)
  vae        latent_mean, latent_logvar: the VAE posterior of the image (cached, not a sample)
             edit_latents: normalised mean latents of the edit image (None without one)
  text       prompt_emb (1, L, D), prompt_emb_mask (1, L): template tokens dropped
  latents    input_latents: the posterior mean (--vae_latents sample: a draw of the posterior, non-deterministic)
  fresh      noise; timestep and loss_weight: a position of TRAINING_SCHEDULE and its weight (non-deterministic)
  packed     input_latents/noise/edit_latents packed into 2x2 patches, img_shapes for RoPE

The edit pipelines (qwen_image_edit, qwen_image_edit_plus, as diffusers' QwenImageEditPipeline and
QwenImageEditPlusPipeline run them) size the edit images on their own, not like the target image:

  edit       edit_pixels: each edit image resized (aspect kept, no crop) to an area of 1024x1024, or
             of the target size when that is smaller (--max_pixels, --height x --width), sides
             multiples of 32, as float tensors (1, 3, 1, H, W); edit_latents: a list of their latents
  vision     condition_images: the edit images as the VL encoder sees them (PIL): for qwen_image_edit
             the edit image at the VAE size, for _plus each at an area of 384x384; the processor (the
             text encoder's companion) turns them into pixel_values and image_grid_thw
  text       prompt_emb with the edit template: the image tokens stay, the 64 system tokens are dropped

Each function is `fn(ctx, **inputs) -> {output: value}` over one sample; it touches only the models
it declares, and a non-deterministic unit draws only from `ctx.rng(purpose)`. torch is imported on
first use, so `unitgraph plan diffusion:qwen_image` reads these declarations without it.
"""

from __future__ import annotations

from typing import Any

from ...data.imaging import area_dimensions, capped_area, image_list, image_to_pixels
from ...data.text import prompt_text
from ...errors import BackendError
from ...family import lazy_module, unit
from ...flowmatch import TrainingSchedule, sample_training_timestep

torch = lazy_module("torch")

# diffusers' QwenImagePipeline prompt template and the number of leading template tokens it drops.
PROMPT_TEMPLATE = (
    "<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, text, "
    "spatial relationships of the objects and background:<|im_end|>\n<|im_start|>user\n{}<|im_end|>\n"
    "<|im_start|>assistant\n"
)
PROMPT_TEMPLATE_DROP = 34
# diffusers' QwenImageEditPipeline / QwenImageEditPlusPipeline template and drop index: the edit pipeline puts
# one VISION_PLACEHOLDER before the prompt (its prompt_template_encode holds it), the plus pipeline one
# "Picture k: " + placeholder per edit image. The 64 dropped tokens are the system prefix up to "user\n".
EDIT_TEMPLATE = (
    "<|im_start|>system\nDescribe the key features of the input image (color, shape, size, texture, objects, "
    "background), then explain how the user's text instruction should alter or modify the image. Generate a new "
    "image that meets the user's requirements while maintaining consistency with the original input where "
    "appropriate.<|im_end|>\n<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
)
EDIT_TEMPLATE_DROP = 64
IMAGE_TOKEN = "<|image_pad|>"
VISION_PLACEHOLDER = "<|vision_start|>" + IMAGE_TOKEN + "<|vision_end|>"
PICTURE_PROMPT = "Picture {}: " + VISION_PLACEHOLDER
VAE_IMAGE_AREA = 1024 * 1024  # diffusers' VAE_IMAGE_SIZE: edit images reach the VAE at this area
CONDITION_IMAGE_AREA = 384 * 384  # diffusers' CONDITION_IMAGE_SIZE: the plus pipeline's VL images
EDIT_MULTIPLE = 32  # diffusers' calculate_dimensions rounds edit image sides to this
TOKENIZER_MAX_LENGTH = 1024
MAX_SEQUENCE_LENGTH = 512
MULTIPLE = 16  # image sides are multiples of this (VAE factor x 2x2 patches)

# ------------------------------------------------------------------------------------------------
# shapes


def image_to_tensor(image: Any, size: Any, dtype: Any) -> torch.Tensor:
    """Resize (cover, then centre crop) and convert a PIL image to (1, 3, 1, H, W) in [-1, 1]."""
    return image_to_pixels(image, size, dtype, MULTIPLE)[:, :, None]


@unit("ShapeChecker", inputs=("image", "edit_image"), outputs=("image", "edit_image", "height", "width"),
      settings=("image_size", "dtype", "cache_dtype"))
def shape_checker(ctx, image: Any, edit_image: Any) -> dict[str, Any]:
    if image is None:
        raise BackendError("sample has no image")
    pixels = image_to_tensor(image, ctx.size, ctx.dtype)
    edit = None if edit_image is None else image_to_tensor(edit_image, ctx.size, ctx.dtype)
    return {"image": pixels, "edit_image": edit, "height": int(pixels.shape[-2]), "width": int(pixels.shape[-1])}


@unit("ShapeChecker", inputs=("image",), outputs=("image", "height", "width"),
      settings=("image_size", "dtype", "cache_dtype"))
def target_shape_checker(ctx, image: Any) -> dict[str, Any]:
    """The edit pipelines' shape checker: the target image only (the edit images are sized by their own units)."""
    if image is None:
        raise BackendError("sample has no image")
    pixels = image_to_tensor(image, ctx.size, ctx.dtype)
    return {"image": pixels, "height": int(pixels.shape[-2]), "width": int(pixels.shape[-1])}


# ------------------------------------------------------------------------------------------------
# edit images (the edit pipelines)


def edit_images(edit_image: Any, many: bool) -> list[Any]:
    """A sample's edit images as a list of RGB PIL images: one for qwen_image_edit, one or more for _plus."""
    images = image_list(edit_image, "edit image", "sample has no edit image (the edit pipelines need an edit_image "
                        "column: --extra_inputs edit_image)")
    if not many and len(images) != 1:
        raise BackendError(f"qwen_image_edit takes one edit image per sample, got {len(images)} "
                           "(qwen_image_edit_plus takes several)")
    return [image if image.mode == "RGB" else image.convert("RGB") for image in images]


def edit_dimensions(area: int, width: int, height: int) -> tuple[int, int]:
    """(width, height) of an image of `area` pixels with the aspect of width x height, sides multiples of 32
    (diffusers' calculate_dimensions; at least 32)."""
    return area_dimensions(area, width, height, EDIT_MULTIPLE)


def vae_edit_area(size: Any) -> int:
    """The area edit images reach the VAE at: 1024x1024 (as diffusers and DiffSynth), or the target size when
    that is smaller (--height x --width, else --max_pixels), so small training runs stay small."""
    return capped_area(size, VAE_IMAGE_AREA)


def resize_edit(image: Any, area: int) -> Any:
    """An edit image resized to `area` (aspect kept, no crop), as diffusers' VaeImageProcessor.resize does (Lanczos)."""
    from PIL import Image

    width, height = edit_dimensions(area, *image.size)
    return image.resize((width, height), resample=Image.Resampling.LANCZOS)


def edit_image_tensor(image: Any, dtype: Any) -> torch.Tensor:
    """A PIL image as (1, 3, 1, H, W) in [-1, 1], with diffusers' VaeImageProcessor.preprocess arithmetic."""
    import numpy as np

    array = np.array(image).astype(np.float32) / 255.0  # H, W, 3
    pixels = 2.0 * torch.from_numpy(array).permute(2, 0, 1)[None] - 1.0
    return pixels[:, :, None].to(dtype)


def _edit_units(many: bool) -> tuple[Any, Any]:
    """The edit image's two preprocessing units: for the VAE, and for the VL encoder (its own unit, so that
    with a LoRA on the text encoder it stays in stage 1 and stage 2 reads its cached output)."""

    @unit("EditImageResizer", inputs=("edit_image",), outputs=("edit_pixels",),
          settings=("image_size", "dtype", "cache_dtype"))
    def edit_image_resizer(ctx, edit_image: Any) -> dict[str, Any]:
        area = vae_edit_area(ctx.size)
        return {"edit_pixels": [edit_image_tensor(resize_edit(im, area), ctx.dtype) for im in edit_images(edit_image, many)]}

    if many:
        @unit("ConditionImageResizer", inputs=("edit_image",), outputs=("condition_images",))
        def condition_image_resizer(ctx, edit_image: Any) -> dict[str, Any]:
            return {"condition_images": [resize_edit(im, CONDITION_IMAGE_AREA) for im in edit_images(edit_image, many)]}
    else:
        # diffusers' edit pipeline shows the VL encoder the very image the VAE encodes
        @unit("ConditionImageResizer", inputs=("edit_image",), outputs=("condition_images",), settings=("image_size",))
        def condition_image_resizer(ctx, edit_image: Any) -> dict[str, Any]:
            return {"condition_images": [resize_edit(im, vae_edit_area(ctx.size)) for im in edit_images(edit_image, many)]}

    return edit_image_resizer, condition_image_resizer


edit_image_resizer, condition_image_resizer = _edit_units(many=False)
edit_images_resizer, condition_images_resizer = _edit_units(many=True)


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
      settings=("dtype", "cache_dtype"), batch="stack")
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


@unit("EditImageEncoder", inputs=("edit_pixels",), outputs=("edit_latents",), models=("vae",),
      settings=("dtype", "cache_dtype"))
def edit_images_encoder(ctx, edit_pixels: list) -> dict[str, Any]:
    """The edit pipelines' edit latents: one (1, z, 1, h, w) mean latent per edit image (diffusers' argmax)."""
    return {"edit_latents": [encode_distribution(ctx, pixels)[0] for pixels in edit_pixels]}


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



def _prompt_batch(ctx, samples: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Prompts of equal token length encoded together: no padding, so each gets what it gets alone."""
    prompts = [prompt_text(s["prompt"]) for s in samples]
    tokenizer = ctx.model("tokenizer")
    lengths = [len(ids) for ids in tokenizer([PROMPT_TEMPLATE.format(p) for p in prompts], truncation=True,
                                             max_length=TOKENIZER_MAX_LENGTH + PROMPT_TEMPLATE_DROP).input_ids]
    groups: dict[int, list[int]] = {}
    for k, length in enumerate(lengths):
        groups.setdefault(length, []).append(k)
    out: list[dict[str, Any]] = [{} for _ in prompts]
    for members in groups.values():
        emb, mask = encode_prompts(ctx, [prompts[k] for k in members])
        for j, k in enumerate(members):
            out[k] = {"prompt_emb": emb[j:j + 1], "prompt_emb_mask": mask[j:j + 1]}
    return out


@unit("PromptEncoder", inputs=("prompt",), outputs=("prompt_emb", "prompt_emb_mask"), models=("text_encoder",),
      settings=("dtype", "cache_dtype"), batch=_prompt_batch)
def prompt_encoder(ctx, prompt: Any) -> dict[str, Any]:
    emb, mask = encode_prompts(ctx, [prompt_text(prompt)])
    return {"prompt_emb": emb, "prompt_emb_mask": mask}


def vl_inputs(processor: Any, texts: list[str], images: list[Any]) -> dict[str, torch.Tensor]:
    """What Qwen2VLProcessor(text=texts, images=images, padding=True) hands the text encoder, made from its
    image processor and tokenizer: each image pad of the texts becomes grid_t*grid_h*grid_w / merge_size**2
    pads, in order (the loader may give the processor as these two parts: transformers builds the
    Qwen2VLProcessor class only with torchvision)."""
    image_processor, tokenizer = processor.image_processor, processor.tokenizer
    vision = image_processor(images=images, return_tensors="pt")
    grid = vision["image_grid_thw"]
    counts = (grid.prod(-1) // int(image_processor.merge_size) ** 2).tolist()
    expanded, k = [], 0
    for text in texts:
        first, *rest = text.split(IMAGE_TOKEN)
        pieces = [first]
        for piece in rest:
            if k >= len(counts):
                raise BackendError(f"the prompts hold more image pads than the {len(counts)} edit images")
            pieces += [IMAGE_TOKEN * int(counts[k]), piece]
            k += 1
        expanded.append("".join(pieces))
    if k != len(counts):
        raise BackendError(f"the prompts hold {k} image pads for {len(counts)} edit images")
    tokens = tokenizer(expanded, padding=True, return_tensors="pt")
    return {"input_ids": tokens["input_ids"], "attention_mask": tokens["attention_mask"],
            "pixel_values": vision["pixel_values"], "image_grid_thw": grid}


def edit_prompt_text(prompt: str, images: int, pictures: bool) -> str:
    """The edit template around a prompt: one vision placeholder (edit), or "Picture k: " + placeholder per image (plus)."""
    vision = "".join(PICTURE_PROMPT.format(i + 1) for i in range(images)) if pictures else VISION_PLACEHOLDER * images
    return EDIT_TEMPLATE.format(vision + prompt)


def encode_edit_prompt(ctx, prompt: str, condition_images: list[Any], pictures: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen-Image-Edit prompt embeddings: the VL encoder reads the prompt and the edit images; the system prefix is dropped."""
    text_encoder = ctx.model("text_encoder")
    inputs = vl_inputs(ctx.model("processor"), [edit_prompt_text(prompt, len(condition_images), pictures)],
                       list(condition_images))
    inputs = {k: v.to(ctx.device) for k, v in inputs.items()}
    out = text_encoder(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"],
                       pixel_values=inputs["pixel_values"], image_grid_thw=inputs["image_grid_thw"],
                       output_hidden_states=True)
    hidden = out.hidden_states[-1][0][inputs["attention_mask"][0].bool()][EDIT_TEMPLATE_DROP:]
    if hidden.shape[0] == 0:
        raise BackendError("the processor's tokenizer does not match the Qwen-Image-Edit prompt template "
                           "(no prompt tokens left after the template)")
    mask = torch.ones(1, hidden.shape[0], dtype=torch.long, device=hidden.device)
    return hidden[None].to(ctx.dtype), mask


def _edit_prompt_unit(pictures: bool) -> Any:
    @unit("EditPromptEncoder", inputs=("prompt", "condition_images"), outputs=("prompt_emb", "prompt_emb_mask"),
          models=("text_encoder",), settings=("dtype", "cache_dtype"))
    def edit_prompt_encoder(ctx, prompt: Any, condition_images: list) -> dict[str, Any]:
        if not isinstance(prompt, str):
            raise BackendError(f"prompt must be a string, got {type(prompt).__name__}")
        emb, mask = encode_edit_prompt(ctx, prompt, condition_images, pictures)
        return {"prompt_emb": emb, "prompt_emb_mask": mask}

    return edit_prompt_encoder


edit_prompt_encoder = _edit_prompt_unit(pictures=False)
edit_plus_prompt_encoder = _edit_prompt_unit(pictures=True)


@unit("NegativePromptEncoder", inputs=("negative_prompt", "cfg_scale"),
      outputs=("negative_prompt_emb", "negative_prompt_emb_mask"), models=("text_encoder",), settings=("dtype", "cache_dtype"))
def negative_prompt_encoder(ctx, negative_prompt: Any, cfg_scale: Any) -> dict[str, Any]:
    if cfg_scale is None or float(cfg_scale) <= 1.0:
        return {"negative_prompt_emb": None, "negative_prompt_emb_mask": None}
    emb, mask = encode_prompts(ctx, [negative_prompt if isinstance(negative_prompt, str) and negative_prompt else " "])
    return {"negative_prompt_emb": emb, "negative_prompt_emb_mask": mask}


# ------------------------------------------------------------------------------------------------
# noise, packing, timesteps


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
    """Packs the target latents and noise, and the edit latents (one tensor, or a list of them: packed each,
    then joined along the tokens, as the DiT reads them after the target's); img_shapes has one entry per image."""
    shapes = [(1, int(input_latents.shape[-2]) // 2, int(input_latents.shape[-1]) // 2)]
    packed_edit = None
    if edit_latents is not None:
        edits = list(edit_latents) if isinstance(edit_latents, (list, tuple)) else [edit_latents]
        shapes += [(1, int(e.shape[-2]) // 2, int(e.shape[-1]) // 2) for e in edits]
        packed = [pack(ctx.tensor(e)) for e in edits]
        packed_edit = packed[0] if len(packed) == 1 else torch.cat(packed, dim=1)
    return {"input_latents": pack(input_latents), "noise": pack(noise), "edit_latents": packed_edit,
            "img_shapes": [shapes]}


# DiffSynth-Studio's "Qwen-Image" training template: mu fixed at 0.8 whatever the image size (diffusers' pipeline
# derives mu from the token count for sampling), the distances from 1 stretched so the last sigma is 0.02.
TRAINING_SCHEDULE = TrainingSchedule(mu=0.8, terminal=0.02)


@unit("TimestepSampler", inputs=(), outputs=("timestep", "loss_weight"), deterministic=False,
      settings=("seed", "timestep_bounds", "loss_weighting", "timestep_sampling", "cache_dtype"))
def timestep_sampler(ctx) -> dict[str, Any]:
    return sample_training_timestep(ctx, TRAINING_SCHEDULE)
