"""The Z-Image family: text-to-image fine-tuning of Tongyi-MAI's Z-Image and Z-Image-Turbo (`z_image`): a single-stream
DiT (image and prompt tokens in one sequence) over Black Forest Labs' 16-channel VAE latents, conditioned on a Qwen3 text
encoder's second-to-last hidden states, trained with DiffSynth-Studio's flow-matching objective and its "Z-Image"
training template (a static shift of 3).

Model names follow DiffSynth-Studio's ZImagePipeline (`dit`, `text_encoder`, `vae_encoder`; `tokenizer`), so its
commands port unchanged; the classes and subfolders are those of diffusers' `ZImagePipeline` (`transformer`,
`text_encoder` (a Qwen3Model), `vae` (an AutoencoderKL), `tokenizer`, `scheduler`). DiffSynth's own Z-Image DiT loads
the released diffusers weights without renaming them (its state-dict converter only strips a `model.diffusion_model.`
prefix other tools add), so its module names are diffusers' (`attention.to_q`, `feed_forward.w1`, ...): the
--lora_target_modules of its LoRA examples (`to_q,to_k,to_v,to_out.0,w1,w2,w3`) need no mapping and are the default
DiT targets, and a LoRA file is written under `transformer.` as `ZImagePipeline.load_lora_weights` reads it.

Prompts are variable in length (the chat template's tokens that the attention mask keeps, as diffusers' encode_prompt
keeps them): a batch pads `prompt_emb` along its tokens and `prompt_emb_mask` marks the real ones, which the loss hands
the DiT as one unpadded sequence per sample, the DiT's own calling convention.

`z_image_omni` trains Z-Image-Omni-Base on edit images, which reach the DiT as clean VAE latents, as SigLIP2 features
(DiffSynth's `image_encoder`, diffusers' `siglip`, with its `siglip_processor`) and as their places in the prompt's
omni template, which the text encoder reads (`omni.py`); `z_image_omni_t2i` trains it text-to-image, through the
same omni template and DiT call without images. The Omni model id names both, and the dataset chooses. The units are
in `units.py`, the loss in `losses.py`, the tiny random-weight configs in `tiny.py`. No torch is imported here.
"""

from __future__ import annotations

from ...family import Family, ModelRepo, ModelSlot, PipelineDef
from ...flowmatch import noise_initializer, posterior_mean
from . import losses, omni, units as u

TURBO_MODEL = "Tongyi-MAI/Z-Image-Turbo"
BASE_MODEL = "Tongyi-MAI/Z-Image"
OMNI_MODEL = "Tongyi-MAI/Z-Image-Omni-Base"

# Tongyi-MAI/Z-Image-Turbo scheduler/scheduler_config.json: a static shift of 3 (no resolution-dependent shift). Used
# when no scheduler folder is given (DiffSynth-style component lists have none); only sampling (validation images)
# reads it: training uses DiffSynth's template (units.TRAINING_SCHEDULE).
SCHEDULER_CONFIG = {
    "num_train_timesteps": 1000,
    "use_dynamic_shifting": False,
    "shift": 3.0,
}

# DiffSynth-Studio's Z-Image LoRA examples (examples/z_image/model_training/lora/Z-Image.sh, Z-Image-Turbo.sh):
# every attention's projections and every feed-forward's three matrices, in the main layers and both refiners.
DIT_LORA_TARGETS = ("to_q", "to_k", "to_v", "to_out.0", "w1", "w2", "w3")
TEXT_LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")  # Qwen3Attention

# The model ids DiffSynth's Z-Image commands name. Its Z-Image.sh takes the DiT of Z-Image and the text encoder and
# VAE of Z-Image-Turbo (the same components): both ids mean the text-to-image pipeline.
REPOS = (
    ModelRepo((OMNI_MODEL,), ("z_image_omni_t2i", "z_image_omni")),  # without or with edit images
    ModelRepo((BASE_MODEL, TURBO_MODEL), "z_image"),
)

SLOTS = (
    ModelSlot("dit", "diffusers", "ZImageTransformer2DModel", "transformer", lora_prefix="transformer",
              lora_targets=DIT_LORA_TARGETS, comfyui=".comfyui:NAMES"),
    ModelSlot("text_encoder", "transformers", "Qwen3Model", "text_encoder", model_types=("qwen3",),
              accepts=("Qwen3ForCausalLM",), lora_prefix="text_encoder", lora_targets=TEXT_LORA_TARGETS,
              tokenizer="tokenizer"),
    ModelSlot("vae_encoder", "diffusers", "AutoencoderKL", "vae", lora_prefix="vae"),
    ModelSlot("tokenizer", "transformers", "Qwen2Tokenizer", "tokenizer", kind="tokenizer",
              accepts=("Qwen2TokenizerFast",), origin=(TURBO_MODEL, "tokenizer/")),
    ModelSlot("scheduler", "diffusers", "FlowMatchEulerDiscreteScheduler", "scheduler", kind="scheduler",
              default_config=SCHEDULER_CONFIG),
    # z_image_omni: the SigLIP2 vision encoder DiffSynth calls `image_encoder` (diffusers' ZImageOmniPipeline:
    # `siglip`) and its image processor, loaded beside it
    ModelSlot("image_encoder", "transformers", "Siglip2VisionModel", "siglip", model_types=("siglip2_vision_model",),
              lora_prefix="siglip"),
    ModelSlot("siglip_processor", "transformers", "Siglip2ImageProcessor", "siglip_processor", kind="processor",
              accepts=("Siglip2ImageProcessorPil", "Siglip2ImageProcessorFast"),
              origin=(OMNI_MODEL, "siglip_processor/")),
)

Z_IMAGE = PipelineDef(
    "z_image", "sft",
    units=(u.shape_checker, u.image_encoder, u.prompt_encoder, posterior_mean, noise_initializer,
           u.timestep_sampler),
    loss=losses.flow_matching_loss,
    description="Z-Image / Z-Image-Turbo text-to-image fine-tuning with the flow-matching loss (Qwen3 prompt "
                "embeddings of variable length)",
)

# Z-Image-Omni-Base's edit training (DiffSynth's Z-Image-Omni-Base.sh with --extra_inputs edit_image): the edit images
# reach the DiT three ways: as clean VAE latents before the target's, as SigLIP2 features, and as their places in the
# prompt's omni template, which the text encoder reads (so a LoRA on it keeps the prompt unit in training).
Z_IMAGE_OMNI = PipelineDef(
    "z_image_omni", "sft",
    units=(u.shape_checker, u.image_encoder, omni.edit_image_resizer, omni.edit_image_embedder_vae,
           omni.edit_image_embedder_siglip, omni.omni_prompt_encoder, posterior_mean, noise_initializer,
           u.timestep_sampler),
    loss=omni.omni_flow_matching_loss,
    description="Z-Image-Omni-Base edit fine-tuning: edit images (edit_image column, one or a JSON list) as clean "
                "latents, SigLIP2 features and places in the Qwen3 prompt",
    required=("image", "prompt", "edit_image"),
    image_params=("image", "edit_image"),
    diffusers_pipeline="ZImageOmniPipeline",
    companions={"image_encoder": ("siglip_processor",)},
)

# Z-Image-Omni-Base's text-to-image training (DiffSynth's Z-Image-Omni-Base.sh, its first command): the omni template
# without images and the Omni DiT's call with the noisy target alone
Z_IMAGE_OMNI_T2I = PipelineDef(
    "z_image_omni_t2i", "sft",
    units=(u.shape_checker, u.image_encoder, omni.omni_t2i_prompt_encoder, posterior_mean, noise_initializer,
           u.timestep_sampler),
    loss=omni.omni_t2i_flow_matching_loss,
    description="Z-Image-Omni-Base text-to-image fine-tuning: the omni prompt template and DiT call without images",
    diffusers_pipeline="ZImageOmniPipeline",
)

FAMILY = Family(
    name="z_image",
    title="Z-Image",
    package=__name__,
    slots=SLOTS,
    pipelines=(Z_IMAGE, Z_IMAGE_OMNI_T2I, Z_IMAGE_OMNI),
    diffusers_pipelines=("ZImagePipeline", "ZImageImg2ImgPipeline", "ZImageInpaintPipeline", "ZImageOmniPipeline"),
    # padded along dim 1 to the longest in a batch; the mask marks the real tokens (1), the loss drops the rest
    pad={"prompt_emb": "prompt_emb_mask"},
    demo={"lora_target_modules": "to_q,to_k,to_v,to_out.0", "lora_rank": 8, "learning_rate": 1e-3},
    render=".render",
    diffsynth=".diffsynth",
    render_models=("vae_encoder",),
    repos=REPOS,
)
