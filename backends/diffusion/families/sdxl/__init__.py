"""The Stable Diffusion XL family: text-to-image fine-tuning of SDXL base 1.0 and its kind (`sdxl`), trained with the
DDPM objective DiffSynth-Studio trains its UNet families with (ddpm.py: epsilon or v prediction, the betas of the
model's own scheduler config).

Model names follow DiffSynth-Studio's StableDiffusionXLPipeline (`unet`, `text_encoder` (CLIP ViT-L),
`text_encoder_2` (OpenCLIP ViT-bigG with its projection), `vae`; `tokenizer`, `tokenizer_2`), which are also the
attributes and subfolders of diffusers' `StableDiffusionXLPipeline`, so its commands port unchanged. DiffSynth's own
SDXL UNet keeps diffusers' module names (`down_blocks.1.attentions.0.transformer_blocks.0.attn1.to_q`, ...): its
--lora_target_modules need no mapping, and a LoRA file is written under `unet.` as
`StableDiffusionXLPipeline.load_lora_weights` reads it. The units are in `units.py`, the loss in `losses.py`, the
tiny random-weight configs in `tiny.py`. No torch is imported here.
"""

from __future__ import annotations

from ...family import Family, ModelRepo, ModelSlot, PipelineDef
from ...flowmatch import latent_sampler, noise_initializer
from . import losses, units as u

SDXL_MODEL = "stabilityai/stable-diffusion-xl-base-1.0"

# stabilityai/stable-diffusion-xl-base-1.0 scheduler/scheduler_config.json, the arguments EulerDiscreteScheduler
# takes (the published file also carries keys of the DDIM/PNDM configs it was made from: real.py writes it whole).
# Used when no scheduler folder is given (DiffSynth-style component lists have none); training reads its betas and
# prediction type (ddpm.DdpmSchedule), sampling uses the scheduler itself.
SCHEDULER_CONFIG = {
    "num_train_timesteps": 1000,
    "beta_start": 0.00085,
    "beta_end": 0.012,
    "beta_schedule": "scaled_linear",
    "trained_betas": None,
    "prediction_type": "epsilon",
    "interpolation_type": "linear",
    "use_karras_sigmas": False,
    "timestep_spacing": "leading",
    "steps_offset": 1,
}
# the scheduler classes an SDXL folder may ship: each config carries the betas and prediction type training reads
SCHEDULER_CLASSES = ("DDIMScheduler", "DDPMScheduler", "PNDMScheduler", "EulerAncestralDiscreteScheduler",
                     "DPMSolverMultistepScheduler", "DPMSolverSinglestepScheduler", "LMSDiscreteScheduler",
                     "HeunDiscreteScheduler", "KDPM2DiscreteScheduler", "DEISMultistepScheduler",
                     "UniPCMultistepScheduler")

# The --lora_target_modules of DiffSynth's SDXL LoRA example (examples/stable_diffusion_xl/model_training/lora/
# stable-diffusion-xl-base-1.0.sh) name 722 modules by their full paths: the attention and feed-forward layers of
# every transformer block and each attention's proj_in/proj_out, in every block that has attention (down_blocks.1-2,
# mid_block, up_blocks.0-1). Reduced to the names they end with, which peft matches as suffixes, they reach exactly
# those modules of UNet2DConditionModel (tests/test_sdxl.py checks this on the released config): the default.
UNET_LORA_TARGETS = ("to_q", "to_k", "to_v", "to_out.0", "ff.net.0.proj", "ff.net.2", "proj_in", "proj_out")
CLIP_LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "out_proj")  # CLIPAttention, in both text encoders

# DiffSynth also reads the original single-file checkpoint at the repository's top (sd_xl_base_1.0.safetensors: the
# UNet, both text encoders and the VAE in Stability's layout); unitgraph reads the diffusers folders of the same
# repository, which a message about that file names (for the UNet, the component a command trains).
RELEASE_FILES = {"sd_xl_base_1.0*.safetensors": "unet/diffusion_pytorch_model.safetensors"}
REPOS = (
    ModelRepo((SDXL_MODEL, "AI-ModelScope/stable-diffusion-xl-base-1.0"), "sdxl", RELEASE_FILES),
)

SLOTS = (
    ModelSlot("unet", "diffusers", "UNet2DConditionModel", "unet", lora_prefix="unet", lora_targets=UNET_LORA_TARGETS,
              comfyui=".comfyui:NAMES"),
    ModelSlot("text_encoder", "transformers", "CLIPTextModel", "text_encoder", lora_prefix="text_encoder",
              lora_targets=CLIP_LORA_TARGETS, tokenizer="tokenizer"),
    ModelSlot("text_encoder_2", "transformers", "CLIPTextModelWithProjection", "text_encoder_2",
              lora_prefix="text_encoder_2", lora_targets=CLIP_LORA_TARGETS, tokenizer="tokenizer_2"),
    ModelSlot("vae", "diffusers", "AutoencoderKL", "vae", lora_prefix="vae"),
    ModelSlot("tokenizer", "transformers", "CLIPTokenizer", "tokenizer", kind="tokenizer",
              accepts=("CLIPTokenizerFast",), origin=(SDXL_MODEL, "tokenizer/")),
    ModelSlot("tokenizer_2", "transformers", "CLIPTokenizer", "tokenizer_2", kind="tokenizer",
              accepts=("CLIPTokenizerFast",), origin=(SDXL_MODEL, "tokenizer_2/")),
    ModelSlot("scheduler", "diffusers", "EulerDiscreteScheduler", "scheduler", kind="scheduler",
              accepts=SCHEDULER_CLASSES, default_config=SCHEDULER_CONFIG),
)

SDXL = PipelineDef(
    "sdxl", "sft",
    # DiffSynth's SDXL pipeline trains on a draw of the VAE posterior (vae.encode(image).sample()): the sampler, in
    # stage 2 (--vae_latents mean puts the posterior mean, computed once in stage 1, in its place)
    units=(u.shape_checker, u.image_encoder, u.clip_prompt_encoder, u.clip_2_prompt_encoder, u.prompt_embed_joiner,
           u.add_time_ids_computer, latent_sampler, noise_initializer, u.timestep_sampler),
    loss=losses.denoising_loss,
    description="SDXL text-to-image fine-tuning with the DDPM loss (the noise, or v for a v-prediction scheduler), "
                "conditioned on both CLIP encoders, the pooled embedding and the size and crop ids",
)

FAMILY = Family(
    name="sdxl",
    title="Stable Diffusion XL",
    package=__name__,
    slots=SLOTS,
    pipelines=(SDXL,),
    diffusers_pipelines=("StableDiffusionXLPipeline", "StableDiffusionXLImg2ImgPipeline",
                         "StableDiffusionXLInpaintPipeline"),
    demo={"lora_target_modules": "to_q,to_k,to_v,to_out.0", "lora_rank": 8, "learning_rate": 1e-3},
    render=".render",
    diffsynth=".diffsynth",
    render_models=("vae",),
    repos=REPOS,
)
