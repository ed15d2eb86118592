"""The Wan family: text-to-video fine-tuning (`wan`, Wan 2.1/2.2 T2V), image-to-video (`wan_i2v`: the
clip's first frame VAE-encoded into the conditioning latents with its mask, and CLIP image features for
Wan 2.1 I2V) and Wan 2.2 TI2V-5B (`wan_ti2v`: its 4x16x16 VAE of 48 channels, one timestep per video token as
diffusers' WanPipeline with expand_timesteps gives it; text-to-video, or image-to-video with DiffSynth's
`--extra_inputs input_image`: the clip's first frame, encoded alone, replaces the first latent frame clean, at
timestep 0, and is left out of the loss, as DiffSynth's TI2V training does).

Model names follow DiffSynth-Studio's WanVideoPipeline (`dit`, `text_encoder`, `vae`, `image_encoder`);
the classes and subfolders are those of diffusers' `WanPipeline` / `WanImageToVideoPipeline` folders
(`Wan-AI/Wan2.1-T2V-1.3B-Diffusers` and kin). DiffSynth's own Wan DiT names its attention modules
q/k/v/o and its MLP ffn.0/ffn.2: they are mapped to diffusers' (`DIT_LORA_ALIASES`), so its
`--lora_target_modules "q,k,v,o,ffn.0,ffn.2"` ports. The I2V units that need the DiT's `image_dim` read
its config only (`configs=("dit",)`), so stage 1 never loads the DiT's weights, where DiffSynth loads
every model in both stages. Wan 2.2 A14B's two experts (`EXPERTS`: `transformer` for high noise,
`transformer_2` for low) share one stage 1; a run trains the one --expert names or the timestep boundaries
select. TI2V-5B keeps DiffSynth's `input_image` (derived from the clip, never a column) and its
`first_frame_latents`; its DiT's `seperated_timestep` / `fuse_vae_embedding_in_latents` are diffusers'
`expand_timesteps`, which model_index.json of a TI2V folder sets and which chooses `wan_ti2v` for it. No torch is
imported here.
"""

from __future__ import annotations

from ...family import Experts, Family, ModelRepo, ModelSlot, PipelineDef
from ...flowmatch import noise_initializer, posterior_mean
from . import losses, units as u

# Wan 2.1's diffusers scheduler (used for sampling; training draws from DiffSynth's shift-5 schedule).
SCHEDULER_CONFIG = {
    "num_train_timesteps": 1000,
    "prediction_type": "flow_prediction",
    "use_flow_sigmas": True,
    "flow_shift": 3.0,
}

DIT_LORA_ALIASES = {
    "q": ("to_q",),
    "k": ("to_k",),
    "v": ("to_v",),
    "o": ("to_out.0",),
    "ffn.0": ("ffn.net.0.proj",),
    "ffn.2": ("ffn.net.2",),
    "k_img": ("add_k_proj",),
    "v_img": ("add_v_proj",),
}
DIFFSYNTH_DIT_TARGETS = ("q", "k", "v", "o", "ffn.0", "ffn.2")  # examples/wanvideo/model_training/lora/*.sh
DIT_LORA_TARGETS = tuple(m for t in DIFFSYNTH_DIT_TARGETS for m in DIT_LORA_ALIASES[t])
TEXT_LORA_TARGETS = ("q", "k", "v", "o")  # UMT5's T5Attention
WAN_MODEL = "Wan-AI/Wan2.1-T2V-1.3B-Diffusers"

# The model ids DiffSynth's Wan commands name. Their release files (the DiT in Wan's own layout, the text encoder,
# VAE and CLIP as pickled .pth files) are not read here: the `-Diffusers` repository of each holds the same models
# in the folders of diffusers' WanPipeline, which a message names instead.
RELEASE_FILES = {
    "diffusion_pytorch_model*.safetensors": "transformer/*.safetensors",
    "high_noise_model/diffusion_pytorch_model*.safetensors": "transformer/*.safetensors",  # Wan 2.2 A14B's experts
    "low_noise_model/diffusion_pytorch_model*.safetensors": "transformer_2/*.safetensors",
    "models_t5_umt5-xxl-enc-bf16.pth": "text_encoder/*.safetensors",
    "Wan2.*_VAE.pth": "vae/*.safetensors",
    "models_clip_open-clip-xlm-roberta-large-vit-huge-14.pth": "image_encoder/*.safetensors",
}
_T2V = ("Wan-AI/Wan2.1-T2V-*", "Wan-AI/Wan2.2-T2V-*")
_I2V = ("Wan-AI/Wan2.1-I2V-*", "Wan-AI/Wan2.2-I2V-*")
_TI2V = ("Wan-AI/Wan2.2-TI2V-5B",)  # text and image to video in one pipeline: --extra_inputs input_image decides
REPOS = (
    ModelRepo(tuple(f"{i}-Diffusers" for i in _T2V), "wan"),
    ModelRepo(tuple(f"{i}-Diffusers" for i in _I2V), "wan_i2v"),
    ModelRepo(tuple(f"{i}-Diffusers" for i in _TI2V), "wan_ti2v"),
    ModelRepo(_T2V, "wan", RELEASE_FILES, "{id}-Diffusers"),
    ModelRepo(_I2V, "wan_i2v", RELEASE_FILES, "{id}-Diffusers"),
    ModelRepo(_TI2V, "wan_ti2v", RELEASE_FILES, "{id}-Diffusers"),
)

SLOTS = (
    ModelSlot("dit", "diffusers", "WanTransformer3DModel", "transformer", lora_prefix="transformer",
              lora_targets=DIT_LORA_TARGETS, lora_aliases=DIT_LORA_ALIASES, comfyui=".comfyui:NAMES"),
    ModelSlot("text_encoder", "transformers", "UMT5EncoderModel", "text_encoder", model_types=("umt5",),
              lora_prefix="text_encoder", lora_targets=TEXT_LORA_TARGETS, tokenizer="tokenizer"),
    ModelSlot("vae", "diffusers", "AutoencoderKLWan", "vae", lora_prefix="vae"),
    ModelSlot("image_encoder", "transformers", "CLIPVisionModel", "image_encoder", model_types=("clip_vision_model",),
              lora_prefix="image_encoder", optional=True),  # Wan 2.2 I2V A14B has none (its DiT takes no image features)
    ModelSlot("tokenizer", "transformers", "T5TokenizerFast", "tokenizer", kind="tokenizer",
              accepts=("T5Tokenizer",), origin=(WAN_MODEL, "tokenizer/")),
    ModelSlot("image_processor", "transformers", "CLIPImageProcessor", "image_processor", kind="processor",
              accepts=("CLIPImageProcessorPil",), origin=("Wan-AI/Wan2.1-I2V-14B-480P-Diffusers", "image_processor/")),
    ModelSlot("scheduler", "diffusers", "UniPCMultistepScheduler", "scheduler", kind="scheduler",
              accepts=("FlowMatchEulerDiscreteScheduler",), default_config=SCHEDULER_CONFIG),
)

# Wan 2.2 A14B: two DiTs of one architecture, `transformer` denoising the timesteps >= boundary_ratio x 1000 (0.875
# for T2V, 0.9 for I2V) and `transformer_2` the rest; DiffSynth's release keeps them in high_noise_model/ and
# low_noise_model/. A run trains one (--expert, or the one --min/max_timestep_boundary select).
EXPERTS = Experts("dit", (("high_noise", "transformer"), ("low_noise", "transformer_2")),
                  (("high_noise", "high_noise_model"), ("low_noise", "low_noise_model")), schedule=u.TRAINING_SCHEDULE,
                  published=(("Wan-AI/Wan2.2-T2V-A14B*", 0.875), ("Wan-AI/Wan2.2-I2V-A14B*", 0.9)),
                  pipelines=("wan", "wan_i2v"))  # TI2V-5B is one DiT

_FRESH = (posterior_mean, noise_initializer, u.timestep_sampler)

WAN = PipelineDef(
    "wan", "sft",
    units=(u.video_shape_checker, u.video_encoder, u.prompt_encoder, *_FRESH),
    loss=losses.flow_matching_loss,
    description="Wan text-to-video fine-tuning (video column: clips of --num_frames frames) with the flow-matching loss",
    required=("video", "prompt"),
    image_params=(),
    video_params=("video",),
)

WAN_I2V = PipelineDef(
    "wan_i2v", "sft",
    units=(u.first_frame, u.video_shape_checker, u.video_encoder, u.image_conditioner, u.image_embedder,
           u.prompt_encoder, *_FRESH),
    loss=losses.i2v_flow_matching_loss,
    description="Wan image-to-video fine-tuning: each clip's first frame conditions it (VAE latents and mask, "
                "CLIP image features for Wan 2.1 I2V)",
    required=("video", "prompt"),
    image_params=(),
    video_params=("video",),
    derived_inputs=("input_image",),
    diffusers_pipeline="WanImageToVideoPipeline",
    companions={"image_encoder": ("image_processor",)},
)

# Wan 2.2 TI2V-5B (DiffSynth's Wan2.2-TI2V-5B.sh): WanPipeline's folder with expand_timesteps. Text-to-video unless
# --extra_inputs input_image names the clip's first frame as the image it starts from (DiffSynth derives it from
# data["video"][0]: no metadata column); the flag is a unit setting, so the two trainings keep separate caches.
WAN_TI2V = PipelineDef(
    "wan_ti2v", "sft",
    units=(u.ti2v_shape_checker, u.video_encoder, u.first_frame_latents, u.prompt_encoder, *_FRESH),
    loss=losses.ti2v_flow_matching_loss,
    description="Wan 2.2 TI2V-5B fine-tuning: text-to-video, or image-to-video from each clip's first frame with "
                "--extra_inputs input_image (a timestep per token, the first frame kept clean)",
    required=("video", "prompt"),
    image_params=(),
    video_params=("video",),
    derived_inputs=("input_image",),
    index_marks={"expand_timesteps": True},  # a TI2V folder (model_index.json) chooses it over `wan`
)

# DiffSynth's special/direct_distill/Wan2.1-T2V-1.3B.sh: a few-step sampler trained towards each clip's latents from
# noise its `seed` column fixes (deterministic, so stage 1 caches it with the latents and the prompt)
WAN_DISTILL = PipelineDef(
    "wan_distill", "direct_distill",
    units=(u.video_shape_checker, u.video_encoder, u.prompt_encoder, posterior_mean, u.seeded_noise),
    loss=losses.direct_distill_loss,
    description="Wan direct distillation: a few-step Euler sampler from seeded noise (seed, num_inference_steps "
                "columns), compared with the clip's latents",
    required=("video", "prompt", "seed", "num_inference_steps"),
    optional=("rand_device", "cfg_scale"),
    image_params=(),
    video_params=("video",),
    param_types={"seed": int, "num_inference_steps": int, "cfg_scale": float},
)

FAMILY = Family(
    name="wan",
    title="Wan",
    package=__name__,
    slots=SLOTS,
    pipelines=(WAN, WAN_I2V, WAN_TI2V, WAN_DISTILL),
    diffusers_pipelines=("WanPipeline", "WanImageToVideoPipeline"),
    demo={"lora_target_modules": "q,k,v,o,ffn.0,ffn.2", "lora_rank": 8, "learning_rate": 1e-3, "num_frames": 9},
    render=".render",
    diffsynth=".diffsynth",
    render_models=("vae",),
    repos=REPOS,
    experts=EXPERTS,
)
