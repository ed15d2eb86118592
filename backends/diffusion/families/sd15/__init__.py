"""The Stable Diffusion 1.5 family: text-to-image fine-tuning of SD 1.5's UNet with the DDPM objective (`sd15`).

Model names follow DiffSynth-Studio's StableDiffusionPipeline (`unet`, `text_encoder` with its `tokenizer`, `vae`),
so its commands port unchanged; the classes and subfolders are those of diffusers' `StableDiffusionPipeline`
folders (stable-diffusion-v1-5 and its mirrors). DiffSynth's own UNet names its modules as diffusers' does (it is
written to load diffusers checkpoints key for key) and its CLIP encoder as transformers' does under a longer prefix,
which peft's suffix matching ignores: no --lora_target_modules name needs mapping. The units are in `units.py`, the loss in `losses.py` (the objective itself
is the shared `ddpm.py`), the tiny random-weight configs in `tiny.py`. No torch is imported here.
"""

from __future__ import annotations

from ...family import Family, ModelRepo, ModelSlot, PipelineDef
from ...flowmatch import latent_sampler, noise_initializer
from . import losses, units as u

# stable-diffusion-v1-5's scheduler/scheduler_config.json (a PNDM sampler over the scaled-linear DDPM betas the UNet
# was trained with), but for its "clip_sample": false, which PNDMScheduler does not take (real.py writes the file
# whole); used when no scheduler folder is given (DiffSynth-style component lists have none). Only the betas and the
# prediction type matter to training (ddpm.DdpmSchedule.from_config).
SCHEDULER_CONFIG = {
    "beta_end": 0.012,
    "beta_schedule": "scaled_linear",
    "beta_start": 0.00085,
    "num_train_timesteps": 1000,
    "set_alpha_to_one": False,
    "skip_prk_steps": True,
    "steps_offset": 1,
    "trained_betas": None,
}
# Scheduler folders whose configs carry the same DDPM betas (a fine-tune may ship another sampler)
SCHEDULERS = ("DDIMScheduler", "DDPMScheduler", "EulerDiscreteScheduler", "EulerAncestralDiscreteScheduler",
              "LMSDiscreteScheduler", "DPMSolverMultistepScheduler", "UniPCMultistepScheduler")

# DiffSynth's SD 1.5 LoRA example passes --lora_target_modules "", which makes DiffSynth search the model itself
# (training_module.auto_detect_lora_target_modules): every Linear with both sides at least 512 inside a list of more
# than one block. On SD 1.5's UNet that is 121 modules of these seven kinds (attention q/k/v/out, the GEGLU
# feed-forward, the resnets' time-embedding projections) in the 640- and 1280-wide blocks. A width rule cannot be a
# list of names, so the default is the seven kinds in every block: 182 modules, DiffSynth's 121 plus those of the
# 320-wide outer blocks and the middle block's q/k/v (tests/test_sd15.py checks it covers DiffSynth's pick).
UNET_LORA_TARGETS = ("to_q", "to_k", "to_v", "to_out.0", "ff.net.0.proj", "ff.net.2", "time_emb_proj")
# The same search on SD 1.5's CLIP text encoder picks every attention and MLP Linear (all 768 or 3072 wide): exact.
TEXT_LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2")

SD15_MODEL = "AI-ModelScope/stable-diffusion-v1-5"  # DiffSynth's SD 1.5 examples and its default tokenizer origin
REPOS = (
    ModelRepo((SD15_MODEL, "runwayml/stable-diffusion-v1-5", "stable-diffusion-v1-5/stable-diffusion-v1-5"), "sd15"),
)

SLOTS = (
    ModelSlot("unet", "diffusers", "UNet2DConditionModel", "unet", lora_prefix="unet", lora_targets=UNET_LORA_TARGETS,
              comfyui=".comfyui:NAMES"),
    ModelSlot("text_encoder", "transformers", "CLIPTextModel", "text_encoder", model_types=("clip_text_model",),
              lora_prefix="text_encoder", lora_targets=TEXT_LORA_TARGETS, tokenizer="tokenizer"),
    ModelSlot("vae", "diffusers", "AutoencoderKL", "vae", lora_prefix="vae"),
    ModelSlot("tokenizer", "transformers", "CLIPTokenizer", "tokenizer", kind="tokenizer",
              accepts=("CLIPTokenizerFast",), origin=(SD15_MODEL, "tokenizer/")),
    ModelSlot("scheduler", "diffusers", "PNDMScheduler", "scheduler", kind="scheduler", accepts=SCHEDULERS,
              default_config=SCHEDULER_CONFIG),
)

SD15 = PipelineDef(
    "sd15", "sft",
    # DiffSynth's SD pipeline trains on a draw of the VAE posterior (vae.encode(image).sample()): the sampler, in
    # stage 2 (--vae_latents mean puts the posterior mean, computed once in stage 1, in its place)
    units=(u.shape_checker, u.image_encoder, u.prompt_encoder, latent_sampler, noise_initializer,
           u.timestep_sampler),
    loss=losses.ddpm_loss,
    description="Stable Diffusion 1.5 text-to-image fine-tuning of the UNet with the DDPM loss (epsilon or v "
                "prediction, as the scheduler config says)",
)

FAMILY = Family(
    name="sd15",
    title="Stable Diffusion 1.5",
    package=__name__,
    slots=SLOTS,
    pipelines=(SD15,),
    diffusers_pipelines=("StableDiffusionPipeline",),
    demo={"lora_rank": 8, "learning_rate": 1e-3},
    render=".render",
    diffsynth=".diffsynth",
    render_models=("vae",),
    repos=REPOS,
)
