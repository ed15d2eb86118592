"""Z-Image-Omni-Base's edit training (`z_image_omni`) and its text-to-image training (`z_image_omni_t2i`): their units
and losses, each declaration right above its code.

Params beyond the z_image pipeline's (one sample), computed as DiffSynth-Studio's ZImagePipeline computes them for a
DiT with a SigLIP embedder, and as diffusers' ZImageOmniPipeline feeds its transformer:

  dataset    edit_image: one PIL image or a list of them (the edit_image column, --extra_inputs edit_image)
  edit       edit_images: each edit image scaled down to at most 1024 x 1024 px, sides cut to multiples of 16
             (DiffSynth's EditImageAutoResize), as PIL images; edit_pixels: the same as (1, 3, h, w) tensors
  vae        edit_latents [[(1, 16, h/8, w/8), ...]]: each edit image's posterior mean, shifted and scaled
  siglip     siglip_embeds [[(sh, sw, C), ...]]: the SigLIP2 encoder's last hidden states per edit image on its
             patch grid (the image_encoder slot with its siglip_processor)
  text       prompt_segments [[(L_j, D), ...]]: the omni template cut at each image's place ("user\\n<vs>",
             "<ve><vs>" between images, "<ve>" + prompt + the assistant's turn + "<vs>", "<ve><|im_end|>"), each
             segment padded to 512 tokens for the text encoder and cut back to its own tokens; the text encoder
             reads the edit image's count, so a LoRA on it keeps this unit (not the image encoders) in training

Lists are per-sample lists inside a one-element list (a batch concatenates them). The loss gives the DiT the edit
latents before the noisy target (noise mask 0 for them, 1 for the target), the segments as the caption, the SigLIP
features with None for the target, t = (1000 - timestep) / 1000, and negates its output: ZImageOmniPipeline's call.

Without edit images (`z_image_omni_t2i`, DiffSynth's uncommented Z-Image-Omni-Base.sh command) the prompt is the omni
template's one segment ("user\n" + prompt + the assistant's turn) and the DiT sees the noisy target alone, noise
mask 1 and no SigLIP features (None for the sample): ZImageOmniPipeline's call without `image`, and DiffSynth's
model_fn_z_image for an Omni DiT given no edit image.

Where this knowingly differs from DiffSynth-Studio's own pipeline: its model_fn_z_image passes the SigLIP features
without the target's None, so its DiT sees no block of SigLIP pad tokens for the target image, where diffusers'
ZImageOmniPipeline (the sampler the trained LoRA is used with) adds one; the loss calls the DiT as the sampler does.
Edit images are sized by DiffSynth's rule (at most 1024 x 1024 px, both the VAE and SigLIP see the cropped image);
diffusers' pipeline resizes only images above 1024 x 1024 px, to the target's area, and gives SigLIP the uncropped one.
"""

from __future__ import annotations

from typing import Any

from ...context import ImageSize
from ...data.imaging import cover_crop, image_list, image_to_pixels
from ...data.text import prompt_text
from ...family import lazy_module, sink, unit
from ...flowmatch import flow_matching_mse
from .units import HIDDEN_LAYER, MAX_SEQUENCE_LENGTH, MULTIPLE, encode_distribution

torch = lazy_module("torch")

EDIT_AREA = 1024 * 1024  # DiffSynth's EditImageAutoResize: max_pixels of an edit image
VISION_START, VISION_END = "<|vision_start|>", "<|vision_end|>"


def edit_list(edit_image: Any) -> list[Any]:
    """A sample's edit images as a list of RGB PIL images."""
    images = image_list(edit_image, "edit image", "sample has no edit image (z_image_omni needs an edit_image column: "
                        "--extra_inputs edit_image)")
    return [image if image.mode == "RGB" else image.convert("RGB") for image in images]


@unit("EditImageResizer", inputs=("edit_image",), outputs=("edit_images", "edit_pixels"), settings=("dtype", "cache_dtype"))
def edit_image_resizer(ctx, edit_image: Any) -> dict[str, Any]:
    size = ImageSize(max_pixels=EDIT_AREA)
    images = [cover_crop(image, size, MULTIPLE) for image in edit_list(edit_image)]
    return {"edit_images": images, "edit_pixels": [image_to_pixels(image, size, ctx.dtype, MULTIPLE) for image in images]}


@unit("EditImageEmbedderVAE", inputs=("edit_pixels",), outputs=("edit_latents",), models=("vae_encoder",),
      settings=("dtype", "cache_dtype"))
def edit_image_embedder_vae(ctx, edit_pixels: list) -> dict[str, Any]:
    return {"edit_latents": [[encode_distribution(ctx, pixels)[0] for pixels in edit_pixels]]}


def siglip_features(ctx, image: Any) -> torch.Tensor:
    """The SigLIP2 encoder's last hidden states of one image on its patch grid: (sh, sw, C)."""
    inputs = ctx.model("siglip_processor")(images=[image], return_tensors="pt")
    shape = [int(s) for s in inputs["spatial_shapes"][0]]
    inputs = {k: v.to(ctx.device) for k, v in inputs.items()}
    hidden = ctx.model("image_encoder")(**inputs).last_hidden_state
    return hidden[0, : shape[0] * shape[1]].reshape(shape[0], shape[1], -1).to(ctx.dtype)


@unit("EditImageEmbedderSiglip", inputs=("edit_images",), outputs=("siglip_embeds",), models=("image_encoder",),
      settings=("dtype", "cache_dtype"))
def edit_image_embedder_siglip(ctx, edit_images: list) -> dict[str, Any]:
    return {"siglip_embeds": [[siglip_features(ctx, image) for image in edit_images]]}


def omni_segments(prompt: str, images: int) -> list[str]:
    """The omni template around a prompt, cut where each image's tokens go (one segment without images)."""
    if images == 0:
        return ["<|im_start|>user\n" + prompt + "<|im_end|>\n<|im_start|>assistant\n"]
    return (["<|im_start|>user\n" + VISION_START] + [VISION_END + VISION_START] * (images - 1)
            + [VISION_END + prompt + "<|im_end|>\n<|im_start|>assistant\n" + VISION_START, VISION_END + "<|im_end|>"])


def encode_segments(ctx, texts: list[str]) -> list[torch.Tensor]:
    """Each text's embedding (L_j, D), padded to 512 tokens for the call and cut back to its own tokens."""
    tokens = ctx.model("tokenizer")(texts, padding="max_length", max_length=MAX_SEQUENCE_LENGTH, truncation=True,
                                    return_tensors="pt")
    ids, mask = tokens.input_ids.to(ctx.device), tokens.attention_mask.to(ctx.device).bool()
    hidden = ctx.model("text_encoder")(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states
    return [h[m].to(ctx.dtype) for h, m in zip(hidden[HIDDEN_LAYER], mask)]


@unit("OmniPromptEncoder", inputs=("prompt", "edit_image"), outputs=("prompt_segments",), models=("text_encoder",),
      settings=("dtype", "cache_dtype"))
def omni_prompt_encoder(ctx, prompt: Any, edit_image: Any) -> dict[str, Any]:
    count = 0 if edit_image is None else len(edit_list(edit_image))
    return {"prompt_segments": [encode_segments(ctx, omni_segments(prompt_text(prompt), count))]}


@unit("OmniPromptEncoder", inputs=("prompt",), outputs=("prompt_segments",), models=("text_encoder",),
      settings=("dtype", "cache_dtype"))
def omni_t2i_prompt_encoder(ctx, prompt: Any) -> dict[str, Any]:
    """z_image_omni_t2i: the omni template without images, one segment."""
    return {"prompt_segments": [encode_segments(ctx, omni_segments(prompt_text(prompt), 0))]}


def predict(ctx, latents: torch.Tensor, timestep: torch.Tensor, prompt_segments: list, edit_latents: Any = None,
            siglip_embeds: Any = None) -> torch.Tensor:
    """The velocity at noisy target latents (B, C, h, w): ZImageOmniPipeline's transformer call, output negated
    (edit_latents None: text-to-image, no SigLIP features)."""
    dit = ctx.model("dit")
    dtype = ctx.model_dtype("dit")
    t = (1000 - timestep.float().reshape(-1).expand(latents.shape[0])) / 1000
    targets = list(latents.to(dtype).unsqueeze(2).unbind(0))
    captions = [[ctx.tensor(s).to(dtype) for s in segments] for segments in prompt_segments]
    if edit_latents is None:
        x, siglip, noise_mask = [[target] for target in targets], [None] * len(targets), [[1]] * len(targets)
    else:
        x = [[ctx.tensor(e)[0].to(dtype).unsqueeze(1) for e in edits] + [target]
             for edits, target in zip(edit_latents, targets)]
        siglip = [[ctx.tensor(s).to(dtype) for s in feats] + [None] for feats in siglip_embeds]
        noise_mask = [[0] * len(edits) + [1] for edits in edit_latents]
    out = dit(x=x, t=t, cap_feats=captions, siglip_feats=siglip, image_noise_mask=noise_mask, return_dict=False)[0]
    return -torch.stack(list(out), dim=0).squeeze(2)


def _loss(ctx, input_latents, noise, timestep, loss_weight, prompt_segments, edit_latents=None,
          siglip_embeds=None) -> torch.Tensor:
    x0, noise = ctx.tensor(input_latents), ctx.tensor(noise)
    t = ctx.tensor(timestep)
    sigma = t.to(x0.dtype).reshape(-1, 1, 1, 1) / 1000.0
    noisy = (1.0 - sigma) * x0 + sigma * noise
    pred = predict(ctx, noisy, t, prompt_segments, edit_latents, siglip_embeds)
    return flow_matching_mse(pred, noise - x0, ctx.tensor(loss_weight))


@sink(inputs=("input_latents", "noise", "timestep", "loss_weight", "prompt_segments", "edit_latents", "siglip_embeds"),
      models=("dit",))
def omni_flow_matching_loss(ctx, input_latents, noise, timestep, loss_weight, prompt_segments, edit_latents,
                            siglip_embeds) -> torch.Tensor:
    """The z_image loss (flow matching, DiffSynth's weight) with the edit images' latents and SigLIP features."""
    return _loss(ctx, input_latents, noise, timestep, loss_weight, prompt_segments, edit_latents, siglip_embeds)


@sink(inputs=("input_latents", "noise", "timestep", "loss_weight", "prompt_segments"), models=("dit",))
def omni_t2i_flow_matching_loss(ctx, input_latents, noise, timestep, loss_weight, prompt_segments) -> torch.Tensor:
    """The z_image loss through the Omni DiT's own call, without edit images."""
    return _loss(ctx, input_latents, noise, timestep, loss_weight, prompt_segments)
