"""The Qwen-Image family: text-to-image fine-tuning (`qwen_image`) and direct distillation (`qwen_image_distill`).

Model names follow DiffSynth-Studio's QwenImagePipeline (`dit`, `vae`, `text_encoder`), so its
commands port unchanged; the classes and subfolders are those of diffusers' `QwenImagePipeline`.
The unit code is in `units.py` (each declaration above its function), the losses in `losses.py`, the
tiny random-weight configs in `tiny.py`. No torch is imported here.
"""

from __future__ import annotations

from ...family import Family, ModelSlot, PipelineDef
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

SLOTS = (
    ModelSlot("dit", "diffusers", "QwenImageTransformer2DModel", "transformer", lora_prefix="transformer",
              lora_targets=DIT_LORA_TARGETS),
    ModelSlot("vae", "diffusers", "AutoencoderKLQwenImage", "vae", lora_prefix="vae"),
    ModelSlot("text_encoder", "transformers", "Qwen2_5_VLForConditionalGeneration", "text_encoder",
              model_types=("qwen2_5_vl",), accepts=("Qwen2_5_VLModel",), lora_prefix="text_encoder",
              lora_targets=TEXT_LORA_TARGETS, tokenizer="tokenizer"),
    ModelSlot("tokenizer", "transformers", "Qwen2Tokenizer", "tokenizer", kind="tokenizer",
              accepts=("Qwen2TokenizerFast",), origin=("Qwen/Qwen-Image", "tokenizer/")),
    ModelSlot("scheduler", "diffusers", "FlowMatchEulerDiscreteScheduler", "scheduler", kind="scheduler",
              default_config=SCHEDULER_CONFIG),
)

_ENCODERS = (u.shape_checker, u.image_encoder, u.edit_image_encoder, u.prompt_encoder)

QWEN_IMAGE = PipelineDef(
    "qwen_image", "sft",
    units=(*_ENCODERS, u.latent_sampler, u.noise_initializer, u.latent_packer, u.timestep_sampler),
    loss=losses.flow_matching_loss,
    description="Qwen-Image text-to-image (and edit) fine-tuning with the flow-matching loss",
)

# The noise comes from the sample's `seed` (metadata), so it is deterministic and cacheable; the
# target is the posterior mean. `num_inference_steps` and `cfg_scale` are dataset values read by the loss.
QWEN_IMAGE_DISTILL = PipelineDef(
    "qwen_image_distill", "direct_distill",
    units=(*_ENCODERS, u.negative_prompt_encoder, u.target_latents, u.seeded_noise, u.latent_packer),
    loss=losses.direct_distill_loss,
    description="Qwen-Image direct distillation: a few-step sampler from seeded noise, compared with the image's latents",
    required=("image", "prompt", "seed", "num_inference_steps"),
    optional=("cfg_scale", "negative_prompt"),
)

FAMILY = Family(
    name="qwen_image",
    title="Qwen-Image",
    package=__name__,
    slots=SLOTS,
    pipelines=(QWEN_IMAGE, QWEN_IMAGE_DISTILL),
    diffusers_pipelines=("QwenImagePipeline", "QwenImageImg2ImgPipeline", "QwenImageInpaintPipeline"),
    # padded along dim 1 to the longest in a batch; the mask marks padding with 0, which the transformer ignores
    pad={"prompt_emb": "prompt_emb_mask", "negative_prompt_emb": "negative_prompt_emb_mask"},
    demo={"lora_target_modules": "to_q,to_k,to_v,to_out.0", "lora_rank": 8, "learning_rate": 1e-3},
)
