"""The FLUX.2 family: text-to-image fine-tuning of FLUX.2-dev (`flux2`, Mistral-Small-3.1 text encoder, a 32 B DiT
with a guidance embedding) and of FLUX.2 [klein] (`flux2_klein`: klein 4B/9B and their -base variants, a Qwen3 text
encoder, a smaller DiT without one), both over the 32-channel AutoencoderKLFlux2's latents; and both with reference
images (`flux2_klein_edit`, `flux2_edit`: DiffSynth's `--extra_inputs "edit_image"`, edit.py), whose tokens follow
the target's. A model id of either release names its text-to-image and its edit pipeline, and the dataset chooses.

Model names follow DiffSynth-Studio's Flux2ImagePipeline, so its commands port unchanged: `dit`, `vae`, `tokenizer`
(one slot for both encoders, as DiffSynth's, `--tokenizer_path "black-forest-labs/FLUX.2-klein-4B:tokenizer/"`
included), `text_encoder` for FLUX.2-dev's Mistral3ForConditionalGeneration and `text_encoder_qwen3` for klein's
Qwen3ForCausalLM. Both encoders sit in `text_encoder/` of their repositories; the folder's config says which slot it
fills, and each pipeline calls one. The classes and subfolders are those of diffusers' `Flux2Pipeline` and
`Flux2KleinPipeline`. DiffSynth's own FLUX.2 DiT keeps diffusers' module names (`to_qkv_mlp_proj`, `linear_in`,
`linear_out`, `single_transformer_blocks.N.attn.to_out`): its --lora_target_modules need no mapping (no
`lora_aliases`), and a LoRA file is written under `transformer.` as the pipelines' `load_lora_weights` read it.

What the units compute (units.py): the VAE posterior patchified 2x2 and normalised with the VAE's batch-norm
statistics, the prompt embedding as three hidden layers of the encoder side by side (Mistral 10/20/30, Qwen3
9/18/27), 4-axis RoPE ids (t, h, w, l) in the loss (losses.py), and DiffSynth's "FLUX.2" training schedule (a fixed
exponential shift, mu 0.8, at every image size). FLUX.2-dev's DiT is told DiffSynth's training guidance, 1.
No torch is imported here.
"""

from __future__ import annotations

from ...family import Family, ModelRepo, ModelSlot, PipelineDef
from ...flowmatch import noise_initializer, posterior_mean
from . import edit, losses, units as u

DEV_MODEL = "black-forest-labs/FLUX.2-dev"
KLEIN_MODEL = "black-forest-labs/FLUX.2-klein-4B"

# FLUX.2's scheduler (scheduler/scheduler_config.json of the FLUX.2 repositories; the values FLUX.1-dev publishes,
# with the exponential time shift Flux2KleinPipeline's empirical mu is made for, `use_dynamic_shifting` on so that
# the pipeline's mu is used). Used when no scheduler folder is given (DiffSynth-style component lists have none);
# training draws from units.TRAINING_SCHEDULE, not from this.
SCHEDULER_CONFIG = {
    "num_train_timesteps": 1000,
    "shift": 3.0,
    "use_dynamic_shifting": True,
    "base_shift": 0.5,
    "max_shift": 1.15,
    "base_image_seq_len": 256,
    "max_image_seq_len": 4096,
    "time_shift_type": "exponential",
    "invert_sigmas": False,
    "shift_terminal": None,
    "stochastic_sampling": False,
    "use_beta_sigmas": False,
    "use_exponential_sigmas": False,
    "use_karras_sigmas": False,
}

# DiffSynth's FLUX.2 LoRA examples (examples/flux2/model_training/lora/FLUX.2-dev.sh; the klein ones list the same
# modules, their single blocks 0-19 only): the attention projections of both streams, the feed-forward layers
# (`linear_in`, `linear_out`), the single blocks' fused projection and each single block's output projection by
# its path. peft matches the names as suffixes and skips paths a smaller DiT lacks, so the list of FLUX.2-dev's
# 48 single blocks serves klein's 20 (4B) and 24 (9B). `to_out.0` is the double blocks' output (a ModuleList
# there, a Linear in the single blocks, hence the paths).
SINGLE_BLOCKS = 48
DIT_LORA_TARGETS = ("to_q", "to_k", "to_v", "add_q_proj", "add_k_proj", "add_v_proj", "to_qkv_mlp_proj", "to_out.0",
                    "to_add_out", "linear_in", "linear_out",
                    *(f"single_transformer_blocks.{i}.attn.to_out" for i in range(SINGLE_BLOCKS)))
QWEN3_LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")  # Qwen3Attention
# Mistral3's language model's attention (its Pixtral vision tower, which text-to-image never runs, names its
# projections `attention.q_proj`, ...: not these)
MISTRAL_LORA_TARGETS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj")

# The model ids DiffSynth's FLUX.2 klein commands name (diffusers layouts all).
# (one checkpoint trains with and without edit images: the dataset's edit_image column decides)
REPOS = (
    ModelRepo(("black-forest-labs/FLUX.2-klein-*",), ("flux2_klein", "flux2_klein_edit")),
    ModelRepo((DEV_MODEL,), ("flux2", "flux2_edit")),
)

SLOTS = (
    ModelSlot("dit", "diffusers", "Flux2Transformer2DModel", "transformer", lora_prefix="transformer",
              lora_targets=DIT_LORA_TARGETS, comfyui=".comfyui:NAMES"),
    # two text encoders of different classes in the same text_encoder/ folder of their repositories: the folder's
    # config.json (model_type) says which slot it fills; each pipeline calls one
    ModelSlot("text_encoder", "transformers", "Mistral3ForConditionalGeneration", "text_encoder",
              model_types=("mistral3",), lora_prefix="text_encoder", lora_targets=MISTRAL_LORA_TARGETS,
              tokenizer="tokenizer"),
    ModelSlot("text_encoder_qwen3", "transformers", "Qwen3ForCausalLM", "text_encoder", model_types=("qwen3",),
              accepts=("Qwen3Model",), lora_prefix="text_encoder", lora_targets=QWEN3_LORA_TARGETS,
              tokenizer="tokenizer"),
    ModelSlot("vae", "diffusers", "AutoencoderKLFlux2", "vae", lora_prefix="vae"),
    # DiffSynth's one `tokenizer` serves both encoders (AutoTokenizer over the folder: FLUX.2-dev's is a Pixtral
    # processor folder, whose tokenizer files are read); its default is FLUX.2-dev's, the klein commands pass theirs
    ModelSlot("tokenizer", "transformers", "PreTrainedTokenizerFast", "tokenizer", kind="tokenizer",
              accepts=("Qwen2Tokenizer", "Qwen2TokenizerFast", "TokenizersBackend", "LlamaTokenizerFast",
                       "PixtralProcessor"), origin=(DEV_MODEL, "tokenizer/")),
    ModelSlot("scheduler", "diffusers", "FlowMatchEulerDiscreteScheduler", "scheduler", kind="scheduler",
              default_config=SCHEDULER_CONFIG),
)

_LATENTS = (posterior_mean, noise_initializer, u.latent_packer, u.timestep_sampler)

FLUX2 = PipelineDef(
    "flux2", "sft",
    units=(u.shape_checker, u.image_encoder, u.prompt_embedder, *_LATENTS),
    loss=losses.flow_matching_loss,
    description="FLUX.2-dev text-to-image fine-tuning with the flow-matching loss (Mistral-Small-3.1 text encoder, "
                "embedded guidance 1 as DiffSynth trains)",
    diffusers_pipeline="Flux2Pipeline",
)

FLUX2_KLEIN = PipelineDef(
    "flux2_klein", "sft",
    units=(u.shape_checker, u.image_encoder, u.qwen3_prompt_embedder, *_LATENTS),
    loss=losses.flow_matching_loss,
    description="FLUX.2 klein text-to-image fine-tuning with the flow-matching loss (Qwen3 text encoder, "
                "batch-normalised 2x2-patchified VAE latents)",
    diffusers_pipeline="Flux2KleinPipeline",
)

_EDIT = (u.shape_checker, u.image_encoder, edit.edit_image_resizer, edit.edit_image_encoder)
_EDIT_DATA = dict(required=("image", "prompt", "edit_image"), image_params=("image", "edit_image"))

FLUX2_KLEIN_EDIT = PipelineDef(
    "flux2_klein_edit", "sft",
    units=(*_EDIT, u.qwen3_prompt_embedder, *_LATENTS),
    loss=edit.edit_flow_matching_loss,
    description="FLUX.2 klein fine-tuning with reference images (edit_image column, one or a JSON list): their VAE "
                "latents as tokens after the target's",
    diffusers_pipeline="Flux2KleinPipeline",
    **_EDIT_DATA,
)

FLUX2_EDIT = PipelineDef(
    "flux2_edit", "sft",
    units=(*_EDIT, u.prompt_embedder, *_LATENTS),
    loss=edit.edit_flow_matching_loss,
    description="FLUX.2-dev fine-tuning with reference images (edit_image column, one or a JSON list): their VAE "
                "latents as tokens after the target's",
    diffusers_pipeline="Flux2Pipeline",
    **_EDIT_DATA,
)

FAMILY = Family(
    name="flux2",
    title="FLUX.2",
    package=__name__,
    slots=SLOTS,
    pipelines=(FLUX2_KLEIN, FLUX2, FLUX2_KLEIN_EDIT, FLUX2_EDIT),
    diffusers_pipelines=("Flux2KleinPipeline", "Flux2Pipeline"),
    demo={"lora_target_modules": "to_q,to_k,to_v,to_out.0", "lora_rank": 8, "learning_rate": 1e-3},
    render=".render",
    render_models=("vae",),
    diffsynth=".diffsynth",
    repos=REPOS,
)
