"""The FLUX.1 family: text-to-image fine-tuning (`flux`, FLUX.1-dev and its kind) and in-context image
editing (`flux_kontext`, FLUX.1 Kontext: reference images encoded by the VAE, their tokens after the target's).

Model names follow DiffSynth-Studio's FluxImagePipeline (`dit`, `text_encoder_1` for CLIP, `text_encoder_2`
for T5, `vae_encoder`; `tokenizer_1`, `tokenizer_2`), so its commands port unchanged; the classes and
subfolders are those of diffusers' `FluxPipeline` / `FluxKontextPipeline`. DiffSynth's own DiT fuses modules
diffusers keeps apart (`a_to_qkv` is q, k and v): its --lora_target_modules names are mapped to diffusers'
(`DIT_LORA_ALIASES`), and a LoRA file is written in the diffusers FLUX format that
`FluxPipeline.load_lora_weights` reads. The units are in `units.py`, the loss in `losses.py`, the tiny
random-weight configs in `tiny.py`. No torch is imported here.
"""

from __future__ import annotations

from ...family import Family, ModelRepo, ModelSlot, PipelineDef
from ...flowmatch import noise_initializer, posterior_mean
from . import losses, units as u

# FLUX.1-dev's scheduler (scheduler/scheduler_config.json): a shift that grows with the image's token
# count; used when no scheduler folder is given (DiffSynth-style component lists have none).
SCHEDULER_CONFIG = {
    "num_train_timesteps": 1000,
    "shift": 3.0,
    "use_dynamic_shifting": True,
    "base_shift": 0.5,
    "max_shift": 1.15,
    "base_image_seq_len": 256,
    "max_image_seq_len": 4096,
}

# DiffSynth-Studio's FLUX DiT module names (its FLUX LoRA examples' --lora_target_modules) -> diffusers'
# FluxTransformer2DModel modules. DiffSynth's double blocks fuse q/k/v per stream (a: image, b: text), its
# single blocks q/k/v and the MLP input (to_qkv_mlp); LoRA on a fused module is LoRA on each part here.
# Matching is by name suffix, as peft's: `to_q` and `proj_out` also reach the single blocks' attention
# and the final projection, which the full DiffSynth list covers anyway (to_qkv_mlp, proj_out).
DIT_LORA_ALIASES = {
    "a_to_qkv": ("to_q", "to_k", "to_v"),
    "b_to_qkv": ("add_q_proj", "add_k_proj", "add_v_proj"),
    "a_to_out": ("to_out.0",),
    "b_to_out": ("to_add_out",),
    "ff_a.0": ("ff.net.0.proj",),
    "ff_a.2": ("ff.net.2",),
    "ff_b.0": ("ff_context.net.0.proj",),
    "ff_b.2": ("ff_context.net.2",),
    "norm1_a.linear": ("norm1.linear",),
    "norm1_b.linear": ("norm1_context.linear",),
    "to_qkv_mlp": ("to_q", "to_k", "to_v", "proj_mlp"),
}
# the list DiffSynth's FLUX LoRA examples pass (examples/flux/model_training/lora/FLUX.1-dev.sh)
DIFFSYNTH_DIT_TARGETS = ("a_to_qkv", "b_to_qkv", "ff_a.0", "ff_a.2", "ff_b.0", "ff_b.2", "a_to_out", "b_to_out",
                         "proj_out", "norm.linear", "norm1_a.linear", "norm1_b.linear", "to_qkv_mlp")
DIT_LORA_TARGETS = tuple(dict.fromkeys(m for t in DIFFSYNTH_DIT_TARGETS for m in DIT_LORA_ALIASES.get(t, (t,))))
CLIP_LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "out_proj")  # CLIPAttention
T5_LORA_TARGETS = ("q", "k", "v", "o")  # T5Attention

FLUX_MODEL = "black-forest-labs/FLUX.1-dev"
# The release files DiffSynth's FLUX commands name at a repository's top (Black Forest Labs' single files, read
# through `single_file.py`) -> the diffusers folders of the same repositories holding the same weights.
RELEASE_FILES = {"flux1-*.safetensors": "transformer/*.safetensors", "ae.safetensors": "vae/*.safetensors"}
REPOS = (
    ModelRepo(("black-forest-labs/FLUX.1-Kontext-*",), "flux_kontext", RELEASE_FILES),
    ModelRepo((FLUX_MODEL, "black-forest-labs/FLUX.1-Krea-dev"), "flux", RELEASE_FILES),
)

SLOTS = (
    ModelSlot("dit", "diffusers", "FluxTransformer2DModel", "transformer", lora_prefix="transformer",
              lora_targets=DIT_LORA_TARGETS, lora_aliases=DIT_LORA_ALIASES, single_file=".single_file:TRANSFORMER",
              comfyui=".comfyui:NAMES"),
    ModelSlot("text_encoder_1", "transformers", "CLIPTextModel", "text_encoder", model_types=("clip_text_model",),
              lora_prefix="text_encoder", lora_targets=CLIP_LORA_TARGETS, tokenizer="tokenizer_1"),
    ModelSlot("text_encoder_2", "transformers", "T5EncoderModel", "text_encoder_2", model_types=("t5",),
              lora_prefix="text_encoder_2", lora_targets=T5_LORA_TARGETS, tokenizer="tokenizer_2"),
    ModelSlot("vae_encoder", "diffusers", "AutoencoderKL", "vae", lora_prefix="vae", single_file=".single_file:AUTOENCODER"),
    ModelSlot("tokenizer_1", "transformers", "CLIPTokenizer", "tokenizer", kind="tokenizer",
              accepts=("CLIPTokenizerFast",), origin=(FLUX_MODEL, "tokenizer/")),
    ModelSlot("tokenizer_2", "transformers", "T5TokenizerFast", "tokenizer_2", kind="tokenizer",
              accepts=("T5Tokenizer",), origin=(FLUX_MODEL, "tokenizer_2/")),
    ModelSlot("scheduler", "diffusers", "FlowMatchEulerDiscreteScheduler", "scheduler", kind="scheduler",
              default_config=SCHEDULER_CONFIG),
)

_TEXT = (u.clip_prompt_encoder, u.t5_prompt_encoder, u.guidance_embedder)
_FRESH = (posterior_mean, noise_initializer, u.latent_packer, u.timestep_sampler)

FLUX = PipelineDef(
    "flux", "sft",
    units=(u.shape_checker, u.image_encoder, *_TEXT, *_FRESH),
    loss=losses.flow_matching_loss,
    description="FLUX.1 text-to-image fine-tuning with the flow-matching loss (embedded guidance: the "
                "embedded_guidance column, else 1)",
    optional=("embedded_guidance",),
    param_types={"embedded_guidance": float},
)

FLUX_KONTEXT = PipelineDef(
    "flux_kontext", "sft",
    units=(u.shape_checker, u.image_encoder, u.kontext_shape_checker, u.kontext_image_encoder, *_TEXT, *_FRESH),
    loss=losses.kontext_flow_matching_loss,
    description="FLUX.1 Kontext fine-tuning: reference images (kontext_images column, one or a JSON list) "
                "encoded by the VAE, their tokens after the target's",
    required=("image", "prompt", "kontext_images"),
    optional=("embedded_guidance",),
    image_params=("image", "kontext_images"),
    param_types={"embedded_guidance": float},
    diffusers_pipeline="FluxKontextPipeline",
)

FAMILY = Family(
    name="flux",
    title="FLUX.1",
    package=__name__,
    slots=SLOTS,
    pipelines=(FLUX, FLUX_KONTEXT),
    diffusers_pipelines=("FluxPipeline", "FluxKontextPipeline", "FluxImg2ImgPipeline", "FluxInpaintPipeline"),
    demo={"lora_target_modules": "to_q,to_k,to_v,to_out.0", "lora_rank": 8, "learning_rate": 1e-3},
    render=".render",
    render_models=("vae_encoder",),
    repos=REPOS,
)
