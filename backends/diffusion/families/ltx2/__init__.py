"""The LTX-2 family: LoRA and full fine-tuning of Lightricks' LTX-2 audio-video DiT on text-to-video clips (`ltx2`):
the joint video and audio flow-matching loss of DiffSynth-Studio's FlowMatchSFTAudioVideoLoss over the video VAE's
latents, the audio VAE's latents of the clip's own sound track when it has one, and the Gemma 3 text encoder's hidden
states of every layer, which the text connectors turn into the video and the audio contexts.

Model names follow DiffSynth-Studio's LTX2AudioVideoPipeline (`dit`, `text_encoder`, `text_encoder_post_modules`,
`video_vae_encoder`, `audio_vae_encoder`; `tokenizer`), so its training commands port; the classes and subfolders are
those of diffusers' `LTX2Pipeline` folders (`transformer`, `text_encoder` (Gemma3ForConditionalGeneration),
`connectors` (LTX2TextConnectors, DiffSynth's post modules), `vae`, `audio_vae`, `tokenizer`, `scheduler`). DiffSynth's
LTX-2 DiT names its attention projections as diffusers' does (`to_q`, `to_k`, `to_v`, `to_out.0`), so its LoRA
examples' --lora_target_modules need no mapping and are the default DiT targets.

DiffSynth's LTX-2 scripts name the single files of its `DiffSynth-Studio/LTX-2-Repackage` repository
(`transformer.safetensors`, `text_encoder_post_modules.safetensors`, `video_vae_encoder.safetensors`,
`audio_vae_encoder.safetensors`) in DiffSynth's own key layout: they are not read here, and a command naming one is
told the subfolder of diffusers' `Lightricks/LTX-2` folders that holds the same component. Gemma
(`google/gemma-3-12b-it-qat-q4_0-unquantized`) is a transformers folder and loads as it is.

The sound comes as in DiffSynth's LTX-2-T2AV-splited.sh: an `input_audio` column (`--data_file_keys "video,input_audio"
--extra_inputs "input_audio"`) names a file, usually the clip's own mp4, whose sound track PyAV reads (data/audio.py);
it is cut to the clip's duration at 24 fps, made stereo at the audio VAE's rate and turned into a log-mel spectrogram
as DiffSynth's AudioProcessor does. A sample without that column, or whose file has no sound track, trains the video
alone, as DiffSynth does (LTX-2-T2AV-noaudio.sh): the DiT's audio stream still runs, on noise, and only the video
term enters the loss. No torch is imported here.
"""

from __future__ import annotations

from ...family import Family, ModelRepo, ModelSlot, PipelineDef
from ...flowmatch import noise_initializer, posterior_mean
from . import losses, units as u

LTX2_MODEL = "Lightricks/LTX-2"
GEMMA_MODEL = "google/gemma-3-12b-it-qat-q4_0-unquantized"

# LTX2Pipeline's sampling schedule: a resolution-dependent exponential shift between 0.95 (1024 tokens) and 2.05
# (4096 tokens), stretched to end at 0.1 (the defaults LTX2Pipeline.__call__ reads from the scheduler config, and
# DiffSynth's set_timesteps_ltx2). Used when no scheduler folder is given; only sampling (validation clips) reads it.
SCHEDULER_CONFIG = {
    "num_train_timesteps": 1000,
    "use_dynamic_shifting": True,
    "base_shift": 0.95,
    "max_shift": 2.05,
    "base_image_seq_len": 1024,
    "max_image_seq_len": 4096,
    "shift_terminal": 0.1,
    "time_shift_type": "exponential",
}

# examples/ltx2/model_training/lora/LTX-2-T2AV-splited.sh and LTX-2-T2AV-noaudio.sh
DIT_LORA_TARGETS = ("to_k", "to_q", "to_v", "to_out.0")
TEXT_LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")  # Gemma3Attention

# DiffSynth's repackaged single files -> the diffusers folders of Lightricks/LTX-2 holding the same components.
RELEASE_FILES = {
    "transformer.safetensors": "transformer/*.safetensors",
    "text_encoder_post_modules.safetensors": "connectors/*.safetensors",
    "video_vae_encoder.safetensors": "vae/*.safetensors",
    "video_vae_decoder.safetensors": "vae/*.safetensors",
    "audio_vae_encoder.safetensors": "audio_vae/*.safetensors",
    "audio_vae_decoder.safetensors": "audio_vae/*.safetensors",
    "ltx-2-19b-*.safetensors": "transformer/*.safetensors",
}
REPOS = (
    ModelRepo(("DiffSynth-Studio/LTX-2-Repackage",), "ltx2", RELEASE_FILES, LTX2_MODEL),
    ModelRepo((LTX2_MODEL,), "ltx2", RELEASE_FILES, LTX2_MODEL),
)

SLOTS = (
    ModelSlot("dit", "diffusers", "LTX2VideoTransformer3DModel", "transformer", lora_prefix="transformer",
              lora_targets=DIT_LORA_TARGETS, comfyui=".comfyui:NAMES"),
    ModelSlot("text_encoder", "transformers", "Gemma3ForConditionalGeneration", "text_encoder", model_types=("gemma3",),
              lora_prefix="text_encoder", lora_targets=TEXT_LORA_TARGETS, tokenizer="tokenizer"),
    ModelSlot("text_encoder_post_modules", "diffusers", "LTX2TextConnectors", "connectors", lora_prefix="connectors",
              module="diffusers.pipelines.ltx2.connectors"),  # diffusers keeps the class beside LTX2Pipeline
    ModelSlot("video_vae_encoder", "diffusers", "AutoencoderKLLTX2Video", "vae", lora_prefix="vae"),
    ModelSlot("audio_vae_encoder", "diffusers", "AutoencoderKLLTX2Audio", "audio_vae", lora_prefix="audio_vae"),
    # only the validation samples' sound needs it (loaded while rendering); a folder without one renders frames only
    ModelSlot("vocoder", "diffusers", "LTX2Vocoder", "vocoder", module="diffusers.pipelines.ltx2.vocoder",
              optional=True),
    ModelSlot("tokenizer", "transformers", "GemmaTokenizerFast", "tokenizer", kind="tokenizer",
              accepts=("GemmaTokenizer",), origin=(GEMMA_MODEL, "tokenizer.json")),  # at the top of Gemma's repo
    ModelSlot("scheduler", "diffusers", "FlowMatchEulerDiscreteScheduler", "scheduler", kind="scheduler",
              default_config=SCHEDULER_CONFIG),
)

LTX2 = PipelineDef(
    "ltx2", "sft",
    units=(u.video_shape_checker, u.video_encoder, u.audio_encoder, u.prompt_encoder, posterior_mean,
           noise_initializer, u.audio_noise_initializer, u.timestep_sampler),
    loss=losses.flow_matching_loss,
    description="LTX-2 text-to-audio-video fine-tuning (video column: clips of --num_frames frames, 8k+1; the clip's "
                "sound track, when it has one, trains the audio stream) with the joint flow-matching loss",
    required=("video", "prompt"),
    optional=("input_audio",),
    image_params=(),
    video_params=("video",),
    audio_params=("input_audio",),
)

FAMILY = Family(
    name="ltx2",
    title="LTX-2",
    package=__name__,
    slots=SLOTS,
    pipelines=(LTX2,),
    diffusers_pipelines=("LTX2Pipeline",),
    # the demo-size DiT carries a video and an audio stream: 8 clips of 64 px keep `unitgraph demo` to minutes
    demo={"lora_target_modules": "to_k,to_q,to_v,to_out.0", "lora_rank": 8, "learning_rate": 1e-3, "num_frames": 9,
          "images": 8, "resolution": 64},
    render=".render",
    render_models=("video_vae_encoder", "audio_vae_encoder", "vocoder"),
    repos=REPOS,
)
