"""The diffusion backend's pipelines, as plain declarations (no torch here).

`PIPELINES` is what the `unitgraph.backends` entry point `diffusion` exposes, so
`unitgraph plan diffusion:qwen_image` resolves without importing torch, diffusers or transformers.
The code that runs each unit lives in `qwen_image.py`, keyed by the unit names declared here.

Params of `qwen_image` (one sample; tensors carry a batch dimension of 1):

  dataset    image (PIL), prompt (str), edit_image (PIL or None: only with --extra_inputs edit_image)
  shape      image/edit_image become float tensors (1, 3, 1, H, W) in [-1, 1]; height, width (ints)
  vae        latent_mean, latent_logvar: the VAE posterior of the image (cached, not a sample)
             edit_latents: normalised mean latents of the edit image (None without one)
  text       prompt_emb (1, L, D), prompt_emb_mask (1, L): template tokens dropped
  fresh      input_latents: a sample of the posterior, normalised; noise; timestep (non-deterministic)
  packed     input_latents/noise/edit_latents packed into 2x2 patches, img_shapes for RoPE
"""

from __future__ import annotations

from unitgraph.spec import Pipeline, Sink, Unit

# Units shared by every Qwen-Image pipeline, up to the prompt encoding (all deterministic).
_SHAPE = Unit(
    "ShapeChecker",
    inputs=("image", "edit_image"),
    outputs=("image", "edit_image", "height", "width"),
)
_IMAGE_ENCODER = Unit("ImageEncoder", inputs=("image",), outputs=("latent_mean", "latent_logvar"), models=("vae",))
_EDIT_ENCODER = Unit("EditImageEncoder", inputs=("edit_image",), outputs=("edit_latents",), models=("vae",))
_PROMPT_ENCODER = Unit(
    "PromptEncoder", inputs=("prompt",), outputs=("prompt_emb", "prompt_emb_mask"), models=("text_encoder",)
)
_PACKER = Unit(
    "LatentPacker",
    inputs=("input_latents", "noise", "edit_latents"),
    outputs=("input_latents", "noise", "edit_latents", "img_shapes"),
)


def qwen_image() -> Pipeline:
    """Qwen-Image text-to-image (and edit) fine-tuning with the flow-matching loss."""
    return Pipeline(
        name="qwen_image",
        units=(
            _SHAPE,
            _IMAGE_ENCODER,
            _EDIT_ENCODER,
            _PROMPT_ENCODER,
            # honest VAE sampling: the cache keeps the posterior, training draws a fresh latent each epoch
            Unit("LatentSampler", inputs=("latent_mean", "latent_logvar"), outputs=("input_latents",), deterministic=False),
            Unit("NoiseInitializer", inputs=("input_latents",), outputs=("noise",), deterministic=False),
            _PACKER,
            Unit("TimestepSampler", inputs=("img_shapes",), outputs=("timestep",), deterministic=False),
        ),
        sink=Sink(
            inputs=("input_latents", "noise", "timestep", "prompt_emb", "prompt_emb_mask", "edit_latents", "img_shapes"),
            models=("dit",),
        ),
    )


def qwen_image_distill() -> Pipeline:
    """Qwen-Image direct distillation: a few-step sampler from seeded noise, compared with the image's latents.

    The noise comes from the sample's `seed` (metadata), so it is deterministic and cacheable; the
    target is the posterior mean. `num_inference_steps` and `cfg_scale` are dataset values read by the loss.
    """
    return Pipeline(
        name="qwen_image_distill",
        units=(
            _SHAPE,
            _IMAGE_ENCODER,
            _EDIT_ENCODER,
            _PROMPT_ENCODER,
            Unit(
                "NegativePromptEncoder",
                inputs=("negative_prompt", "cfg_scale"),
                outputs=("negative_prompt_emb", "negative_prompt_emb_mask"),
                models=("text_encoder",),
            ),
            Unit("TargetLatents", inputs=("latent_mean",), outputs=("input_latents",)),
            Unit("SeededNoise", inputs=("input_latents", "seed"), outputs=("noise",)),
            _PACKER,
        ),
        sink=Sink(
            inputs=(
                "input_latents", "noise", "prompt_emb", "prompt_emb_mask", "negative_prompt_emb",
                "negative_prompt_emb_mask", "edit_latents", "img_shapes", "num_inference_steps", "cfg_scale",
            ),
            models=("dit",),
        ),
    )


PIPELINES = {"qwen_image": qwen_image, "qwen_image_distill": qwen_image_distill}

# The pipeline each --task family runs.
TASK_PIPELINES = {"sft": "qwen_image", "direct_distill": "qwen_image_distill"}
