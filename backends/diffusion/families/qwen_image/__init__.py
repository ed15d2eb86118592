"""The Qwen-Image family: text-to-image fine-tuning (`qwen_image`), image editing with one edit image
(`qwen_image_edit`, Qwen-Image-Edit) or several (`qwen_image_edit_plus`, Qwen-Image-Edit-2509 and later),
and direct distillation (`qwen_image_distill`).

Model names follow DiffSynth-Studio's QwenImagePipeline (`dit`, `vae`, `text_encoder`), so its
commands port unchanged; the classes and subfolders are those of diffusers' `QwenImagePipeline`
(`QwenImageEditPipeline` / `QwenImageEditPlusPipeline` for the edit pipelines, whose text encoder reads
the edit images through the `processor` slot: a Qwen2VLProcessor folder, `--processor_path`).
The unit code is in `units.py` (each declaration above its function), the losses in `losses.py`, the
tiny random-weight configs in `tiny.py`. No torch is imported here.
"""

from __future__ import annotations

from ...family import Family, ModelRepo, ModelSlot, PipelineDef
from ...flowmatch import noise_initializer, posterior_mean
from . import losses, units as u

# Qwen-Image's published scheduler configuration (scheduler/scheduler_config.json); used when no
# scheduler folder is given (DiffSynth-style component lists have none).
SCHEDULER_CONFIG = {
    "num_train_timesteps": 1000,
    "shift": 1.0,
    "use_dynamic_shifting": True,
    "base_shift": 0.5,
    "max_shift": 0.9,
    "base_image_seq_len": 256,
    "max_image_seq_len": 8192,
    "invert_sigmas": False,
    "shift_terminal": 0.02,
    "use_karras_sigmas": False,
    "use_exponential_sigmas": False,
    "use_beta_sigmas": False,
    "time_shift_type": "exponential",
    "stochastic_sampling": False,
}

# The modules DiffSynth-Studio's Qwen-Image LoRA examples target.
DIT_LORA_TARGETS = ("to_q", "to_k", "to_v", "add_q_proj", "add_k_proj", "add_v_proj", "to_out.0", "to_add_out",
                    "img_mlp.net.2", "img_mod.1", "txt_mlp.net.2", "txt_mod.1")
TEXT_LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")

# The model ids DiffSynth's Qwen-Image commands name (diffusers layouts all), most specific first; the others of
# the line name the family, and the dataset's columns choose its pipeline.
REPOS = (
    ModelRepo(("Qwen/Qwen-Image-Edit-25*",), "qwen_image_edit_plus"),
    ModelRepo(("Qwen/Qwen-Image-Edit",), "qwen_image_edit"),
    ModelRepo(("Qwen/Qwen-Image", "Qwen/Qwen-Image-2512"), "qwen_image"),
    ModelRepo(("Qwen/Qwen-Image*", "DiffSynth-Studio/Qwen-Image*")),
)

SLOTS = (
    ModelSlot("dit", "diffusers", "QwenImageTransformer2DModel", "transformer", lora_prefix="transformer",
              lora_targets=DIT_LORA_TARGETS, comfyui=".comfyui:NAMES"),
    ModelSlot("vae", "diffusers", "AutoencoderKLQwenImage", "vae", lora_prefix="vae"),
    ModelSlot("text_encoder", "transformers", "Qwen2_5_VLForConditionalGeneration", "text_encoder",
              model_types=("qwen2_5_vl",), accepts=("Qwen2_5_VLModel",), lora_prefix="text_encoder",
              lora_targets=TEXT_LORA_TARGETS, tokenizer="tokenizer"),
    ModelSlot("tokenizer", "transformers", "Qwen2Tokenizer", "tokenizer", kind="tokenizer",
              accepts=("Qwen2TokenizerFast",), origin=("Qwen/Qwen-Image", "tokenizer/")),
    ModelSlot("scheduler", "diffusers", "FlowMatchEulerDiscreteScheduler", "scheduler", kind="scheduler",
              default_config=SCHEDULER_CONFIG),
    # the edit pipelines' processor (DiffSynth's --processor_path, default Qwen/Qwen-Image-Edit:processor/)
    ModelSlot("processor", "transformers", "Qwen2VLProcessor", "processor", kind="processor",
              accepts=("Qwen2_5_VLProcessor",), origin=("Qwen/Qwen-Image-Edit", "processor/")),
)

# the image files a sample may name: the target and, with --extra_inputs edit_image, an edit image
_IMAGES = ("image", "edit_image")
_ENCODERS = (u.shape_checker, u.image_encoder, u.edit_image_encoder, u.prompt_encoder)

QWEN_IMAGE = PipelineDef(
    "qwen_image", "sft",
    units=(*_ENCODERS, posterior_mean, noise_initializer, u.latent_packer, u.timestep_sampler),
    loss=losses.flow_matching_loss,
    description="Qwen-Image text-to-image (and edit) fine-tuning with the flow-matching loss",
    image_params=_IMAGES,
)

# The edit pipelines: the edit images reach the DiT as extra tokens after the target's (their latents,
# one img_shapes entry each; the loss reads the target tokens only) and the text encoder as images
# through the processor (pixel_values, image_grid_thw). The VL preprocessing of the edit images is its
# own unit (ConditionImageResizer), so a LoRA on the text encoder leaves it, and the VAE, in stage 1.
_EDIT_COMPANIONS = {"text_encoder": ("processor",)}


def _edit_pipeline(name: str, diffusers_class: str, resizers: tuple, prompt_encoder, description: str) -> PipelineDef:
    edit_resizer, condition_resizer = resizers
    return PipelineDef(
        name, "sft",
        units=(u.target_shape_checker, u.image_encoder, edit_resizer, u.edit_images_encoder, condition_resizer,
               prompt_encoder, posterior_mean, noise_initializer, u.latent_packer, u.timestep_sampler),
        loss=losses.flow_matching_loss,
        description=description,
        required=("image", "prompt", "edit_image"),
        image_params=_IMAGES,
        diffusers_pipeline=diffusers_class,
        companions=_EDIT_COMPANIONS,
    )


QWEN_IMAGE_EDIT = _edit_pipeline(
    "qwen_image_edit", "QwenImageEditPipeline", (u.edit_image_resizer, u.condition_image_resizer), u.edit_prompt_encoder,
    "Qwen-Image-Edit fine-tuning: one edit image per sample (edit_image column), seen by the DiT and the VL text encoder")
QWEN_IMAGE_EDIT_PLUS = _edit_pipeline(
    "qwen_image_edit_plus", "QwenImageEditPlusPipeline", (u.edit_images_resizer, u.condition_images_resizer),
    u.edit_plus_prompt_encoder,
    "Qwen-Image-Edit-2509 fine-tuning: one or more edit images per sample (edit_image: a JSON list of files)")

# The noise comes from the sample's `seed` (metadata), so it is deterministic and cacheable; the
# target is the posterior mean. `num_inference_steps` and `cfg_scale` are dataset values read by the loss.
QWEN_IMAGE_DISTILL = PipelineDef(
    "qwen_image_distill", "direct_distill",
    units=(*_ENCODERS, u.negative_prompt_encoder, u.target_latents, u.seeded_noise, u.latent_packer),
    loss=losses.direct_distill_loss,
    description="Qwen-Image direct distillation: a few-step sampler from seeded noise, compared with the image's latents",
    required=("image", "prompt", "seed", "num_inference_steps"),
    optional=("cfg_scale", "negative_prompt"),
    image_params=_IMAGES,
    param_types={"seed": int, "num_inference_steps": int, "cfg_scale": float},
)

FAMILY = Family(
    name="qwen_image",
    title="Qwen-Image",
    package=__name__,
    slots=SLOTS,
    pipelines=(QWEN_IMAGE, QWEN_IMAGE_EDIT, QWEN_IMAGE_EDIT_PLUS, QWEN_IMAGE_DISTILL),
    diffusers_pipelines=("QwenImagePipeline", "QwenImageImg2ImgPipeline", "QwenImageInpaintPipeline",
                         "QwenImageEditPipeline", "QwenImageEditPlusPipeline"),
    # padded along dim 1 to the longest in a batch; the mask marks padding with 0, which the transformer ignores
    pad={"prompt_emb": "prompt_emb_mask", "negative_prompt_emb": "negative_prompt_emb_mask"},
    demo={"lora_target_modules": "to_q,to_k,to_v,to_out.0", "lora_rank": 8, "learning_rate": 1e-3},
    render=".render",
    render_models=("vae",),
    repos=REPOS,
    diffsynth=".diffsynth",
)
