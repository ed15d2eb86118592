"""How each of DiffSynth-Studio's trainable pipelines is put together for training, as its `train.py` does it.

The part of a DiffSynth training step that lives in its repository's examples rather than in the `diffsynth`
package is small: the dtype the pipeline is built in, the tokenizer folders `from_pretrained` takes (and the model
ids they default to), and how a dataset row becomes the pipeline's inputs. `Glue` (family.DiffSynthPipeline)
declares those per pipeline: a family of unitgraph's that trains the same models declares its own in its folder
(`Family.diffsynth`), and DiffSynth's pipelines of no family are listed here (`OWN`); `glues()` gathers them. Only
pipelines whose step unitgraph checks against DiffSynth's own in the tests are listed. `inputs` builds the three
input dicts the way the image pipelines' `get_pipeline_inputs` does.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

from ..errors import BackendError
from ..family import DiffSynthPipeline, DiffSynthTensor, DiffSynthTokenizer

__all__ = ["Glue", "OWN", "Tokenizer", "call_types", "glue_for", "glues", "inputs", "provided"]


Glue = DiffSynthPipeline
Tokenizer = DiffSynthTokenizer

# DiffSynth's pipelines of no family of unitgraph's; a family's own are in its folder (`Family.diffsynth`)
OWN: tuple[Glue, ...] = (
    Glue("ideogram4", "Ideogram4Pipeline", "Ideogram 4 (DiffSynth's pipeline; no other trainer has it)",
         tokenizers=(Tokenizer("tokenizer_config", "tokenizer_path", "ideogram-ai/ideogram-4-fp8", "tokenizer/"),),
         example="ideogram4", distill=False),
    # its prompt unit reads a Qwen3 encoder's hidden states and T5's token ids of the same prompt (the DiT's adapter
    # embeds them)
    Glue("anima_image", "AnimaImagePipeline", "Anima (DiffSynth's pipeline)",
         tokenizers=(Tokenizer("tokenizer_config", "tokenizer_path", "Qwen/Qwen3-0.6B", "./"),
                     Tokenizer("tokenizer_t5xxl_config", "tokenizer_t5xxl_path", "stabilityai/stable-diffusion-3.5-large",
                               "tokenizer_3/")),
         example="anima",
         # DiffSynth 2.1.12's table comments its Anima text encoder's entry with the VAE's file name, and names no
         # example of the VAE: the dry run sizes each by the entry its file is (the VAE's by its entry's hash)
         sized_as=(("circlestone-labs/Anima:split_files/text_encoders/qwen_3_06b_base.safetensors",
                    "circlestone-labs/Anima:split_files/vae/qwen_image_vae.safetensors"),
                   ("circlestone-labs/Anima:split_files/vae/qwen_image_vae.safetensors",
                    "md5:ccc42284ea13e1ad04693284c7a09be6"))),
    # its prompt unit reads the second-to-last hidden states of a Ministral 3 encoder, one prompt at a time
    Glue("ernie_image", "ErnieImagePipeline", "ERNIE-Image (DiffSynth's pipeline)",
         tokenizers=(Tokenizer("tokenizer_config", "tokenizer_path", "PaddlePaddle/ERNIE-Image", "tokenizer/"),),
         example="ernie_image", distill=False),
    # its prompt unit reads 12 hidden layers of a Qwen3-VL encoder over a fixed 541 tokens; its DiT's attention asks
    # torch for cuDNN's kernel alone (CUDA only)
    Glue("krea2", "Krea2Pipeline", "Krea 2 (DiffSynth's pipeline)",
         tokenizers=(Tokenizer("tokenizer_config", "tokenizer_path", "Qwen/Qwen3-VL-4B-Instruct", ""),),
         example="krea2", distill=False,
         opensource_lora="diffsynth.utils.lora.krea2:Krea2LoRAConverter.align_to_opensource_format",
         attention="diffsynth.models.krea2_dit:attention"),
    # its prompt unit reads Qwen3-VL's last hidden states of a chat-framed caption through a processor (--processor_path,
    # which its train.py has no default for; Krea 2's encoder folder here); its get_pipeline_inputs sets `seed` None
    # and no negative side, and passes the timestep boundaries
    Glue("lingbot_video", "LingBotVideoPipeline", "LingBot-Video (DiffSynth's pipeline)",
         tokenizers=(Tokenizer("processor_config", "processor_path", "Qwen/Qwen3-VL-4B-Instruct", ""),),
         columns=("video", "prompt"), example="lingbot_video", media="video", constants=(("seed", None),),
         boundaries=True, negative=None, distill=False),
    # its prompt unit reads the last hidden states of a Qwen3-VL 8B encoder over a chat-framed instruction, through a
    # processor (its train.py's default: the release's mllm/ folder, which holds the encoder's shards too)
    Glue("boogu_image", "BooguImagePipeline", "Boogu-Image (DiffSynth's pipeline)",
         tokenizers=(Tokenizer("processor_config", "processor_path", "Boogu/Boogu-Image-0.1-Base", "mllm/"),),
         example="boogu_image", distill=False,
         # its example's patterns, which DiffSynth 2.1.12's table names under other patterns (its DiT's shards) or
         # other releases (the encoder is Qwen-Image 2.1's; the VAE Z-Image-Turbo's diffusers one), by the entries
         sized_as=(("Boogu/Boogu-Image-0.1-Base:transformer/*.safetensors", "md5:8e29d2d28b83530320ae1d2c5eb323b3"),
                   ("Boogu/Boogu-Image-0.1-Base:mllm/*.safetensors", "md5:2d11bf14bba8b4e87477c8199a895403"),
                   ("Boogu/Boogu-Image-0.1-Base:vae/*.safetensors", "md5:1aafa3cc91716fb6b300cc1cd51b85a3"))),
    # image editing: its prompt unit reads Boogu's Qwen3-VL 8B encoder's last hidden states over the instruction and
    # the picture it edits, through a processor (its train.py's default: the release's JoyAI-Image-Und/ folder, which
    # holds the encoder's shards too), and cannot encode an instruction alone (`edits`); its DiT and its VAE are
    # released as `.pth` pickles, read from their safetensors twins (models/twin.py)
    Glue("joyai_image", "JoyAIImagePipeline", "JoyAI-Image (DiffSynth's pipeline)",
         tokenizers=(Tokenizer("processor_config", "processor_path", "jd-opensource/JoyAI-Image-Edit",
                               "JoyAI-Image-Und/"),),
         example="joyai_image", distill=False, edits=True,
         # its example's patterns, which DiffSynth 2.1.12's table names under another pattern (the encoder's shards:
         # `model-*`) or another release (the VAE), by the entries
         sized_as=(("jd-opensource/JoyAI-Image-Edit:JoyAI-Image-Und/model*.safetensors",
                    "md5:2d11bf14bba8b4e87477c8199a895403"),
                   ("jd-opensource/JoyAI-Image-Edit:vae/Wan2.1_VAE.pth", "md5:ccc42284ea13e1ad04693284c7a09be6"))),
    # one model: a Qwen3-VL 8B turned DiT that reads the prompt's tokens and the picture's 32 px patches itself (no
    # VAE, no text encoder); its prompt unit only tokenizes, through a processor (--processor_config; its train.py's
    # default: the release's root, beside the DiT's shards) with the DiT's configuration's token ids, so stage 1
    # loads no model; its get_pipeline_inputs hands --noise_scale (the noise's scale, 8 by default) and " " as the
    # negative prompt
    Glue("hidream_o1_image", "HiDreamO1ImagePipeline", "HiDream-O1-Image (DiffSynth's pipeline)",
         tokenizers=(Tokenizer("processor_config", "processor_config", "HiDream-ai/HiDream-O1-Image-Dev", "./",
                               encoder=""),),
         division=32, min_cells=2, example="hidream_o1_image", distill=False, negative=" ",
         options=(("noise_scale", 8.0),),
         # its example's release, which DiffSynth 2.1.12's table names by the non-distilled one's example
         sized_as=(("HiDream-ai/HiDream-O1-Image-Dev:model-*.safetensors", "md5:58a7c1073d79556bfc61e05e6061b771"),)),
    # text to music: its dataset reads a song (`audio`) at 48 kHz with LoadPureAudioWithTorchaudio, its
    # get_pipeline_inputs hands the song, its length in whole seconds, the lyrics and the metadata columns (with its
    # defaults), the sides marked `positive`; its context unit reads a silence latent its from_pretrained unpickles
    Glue("ace_step", "AceStepPipeline", "ACE-Step 1.5 (DiffSynth's pipeline)",
         tokenizers=(Tokenizer("text_tokenizer_config", "tokenizer_path", "ACE-Step/Ace-Step1.5",
                               "Qwen3-Embedding-0.6B/"),),
         columns=("audio", "prompt", "lyrics"), example="ace_step", media="audio", sample_rate=48000,
         constants=(("task_type", "text2music"),), negative=None, distill=False, sides=True,
         defaults=(("bpm", 100), ("keyscale", "C major"), ("timesignature", "4"), ("vocal_language", "unknown")),
         quiet_without=(("AceStepUnit_ReferenceAudioEmbedder", "reference_audios"),),
         tensors=(DiffSynthTensor("silence_latent_config", "silence_latent_path", "ACE-Step/Ace-Step1.5",
                                  "acestep-v15-turbo/silence_latent.pt", "silence_latent", (1, 2),
                                  ("vae", "tokenizer_model")),)),
)


def family_modules() -> list[Any]:
    """The `diffsynth` modules of the registered families that declare one (imported now; torch-free)."""
    import importlib

    from ..registry import families

    return [importlib.import_module(f.diffsynth, f.package) for f in families() if f.diffsynth]


def glues() -> tuple[Glue, ...]:
    """Every DiffSynth pipeline unitgraph trains through DiffSynth's own code: the families' first, then its own."""
    return tuple(g for module in family_modules() for g in module.PIPELINES) + OWN


def glue_for(name: str) -> Glue:
    """The glue of `diffsynth:MODULE` (or MODULE); one line naming the listed ones for another."""
    module = name.split(":", 1)[1] if name.startswith("diffsynth:") else name
    module = module.split(".", 1)[0]
    for glue in glues():
        if glue.module == module:
            return glue
    listed = ", ".join(g.name for g in glues())
    raise BackendError(f"DiffSynth's pipeline {module!r} is not trained through DiffSynth's own code yet "
                       f"(trained this way: {listed})")


def inputs(glue: Glue, sample: Mapping[str, Any], device: Any, gradient_checkpointing: bool,
           gradient_checkpointing_offload: bool, extra_inputs: tuple[str, ...] = (),
           boundaries: tuple[float, float] = (1.0, 0.0), options: Optional[Mapping[str, Any]] = None
           ) -> tuple[dict, dict, dict]:
    """(inputs_shared, inputs_posi, inputs_nega) of one sample, as the example's `get_pipeline_inputs` builds them:
    the picture (an image pipeline's `input_image`; a video pipeline's `input_video` frames and their count) and its
    size, `cfg_scale` 1, the pipeline's device as `rand_device`, the gradient checkpointing flags (on whatever they
    say where the example's train.py forces it), the glue's constants, the timestep boundaries where the example
    passes them (`boundaries`: max, min), the values of its own flags (`options`: the glue's, their defaults where
    not given), the clip's `frame_rate` where the example hands one, and each --extra_inputs
    column by its own name (a video pipeline's `input_image` / `end_image`: the clip's first / last frame; a sound
    column: what DiffSynth's audio operator made of it, run.sample_state)."""
    if glue.media == "video":
        frames = sample["video"]
        shared: dict[str, Any] = {"input_video": frames, "height": frames[0].size[1], "width": frames[0].size[0],
                                  "num_frames": len(frames)}
    elif glue.media == "audio":  # (waveform, rate) as LoadPureAudioWithTorchaudio gives it, and its whole seconds
        waveform, rate = sample["audio"]
        shared = {"input_audio": sample["audio"], "lyrics": sample.get("lyrics") or "",
                  "duration": waveform.shape[1] // rate}
    else:
        image = sample["image"]
        shared = {"input_image": image, "height": image.size[1], "width": image.size[0]}
    shared.update({
        "cfg_scale": 1,
        "rand_device": device,
        "use_gradient_checkpointing": gradient_checkpointing or glue.checkpointing,
        "use_gradient_checkpointing_offload": gradient_checkpointing_offload,
    })
    shared.update(dict(glue.constants))
    for name, default in glue.options:
        shared[name] = default if (options or {}).get(name) is None else options[name]
    for name, default in glue.defaults:  # its data.get(name, default)
        shared[name] = default if sample.get(name) is None else sample[name]
    if glue.frame_rate:  # the row's frame_rate column, else 24 (MOVA's get_pipeline_inputs: data.get("frame_rate", 24))
        shared["frame_rate"] = 24 if sample.get("frame_rate") is None else sample["frame_rate"]
    if glue.boundaries:
        shared["max_timestep_boundary"], shared["min_timestep_boundary"] = boundaries
    for name in extra_inputs:
        if name.startswith(("controlnet_", "blockwise_controlnet_")):
            raise BackendError(f"--extra_inputs {name}: ControlNet inputs are not trained through DiffSynth's own "
                               "pipelines yet")
        if glue.media == "video" and name in ("input_image", "end_image"):
            shared[name] = sample["video"][0 if name == "input_image" else -1]
        else:
            shared[name] = sample.get(name)
    negative = {} if glue.negative is None else {"negative_prompt": glue.negative}
    positive = {"prompt": sample["prompt"]}
    if glue.sides:
        positive["positive"], negative["positive"] = True, False
    return shared, positive, negative


def provided(glue: Glue, extra_inputs: tuple[str, ...] = ()) -> frozenset[str]:
    """The params a sample's inputs give (what `inputs` sets, None-valued ones aside): a unit that does nothing
    without one of its other params (its `requires`, read from its code by the adapter) is left out of the plan,
    as DiffSynth's runner would run it to no effect."""
    from PIL import Image

    import numpy as np

    picture = Image.new("RGB", (16, 16))
    sample = {"video": [picture], "image": picture, "audio": (np.zeros((2, 16), np.float32), 16), "prompt": "",
              "lyrics": "", **{n: 0 for n in extra_inputs}}
    given = inputs(glue, sample, "cpu", False, False, extra_inputs)
    return frozenset(k for part in given for k, v in part.items() if v is not None)


def call_types(pipeline_class: type) -> dict[str, type]:
    """{param: int or float} of the pipeline's `__call__` parameters annotated so (`seed: int`,
    `num_inference_steps: int`, `cfg_scale: float`, an Optional one too): a metadata column of --extra_inputs that
    names one is read as that number, as DiffSynth's dataset (pandas) reads a numeric column, not as the csv's text.

    >>> class Pipe:
    ...     def __call__(self, prompt: str, seed: int = None, cfg_scale: float = 5.0, tiled: bool = True): ...
    >>> call_types(Pipe)
    {'seed': <class 'int'>, 'cfg_scale': <class 'float'>}
    """
    import inspect
    import typing

    call = pipeline_class.__call__
    try:
        hints = typing.get_type_hints(call)  # annotations written as text (postponed) resolved
    except Exception:  # a name the module does not define: the annotations as they are
        hints = {}
    found: dict[str, type] = {}
    for name, param in inspect.signature(call).parameters.items():
        annotation = hints.get(name, param.annotation)
        kinds = typing.get_args(annotation) or (annotation,)
        numbers = [k for k in kinds if k in (int, float)]
        if len(numbers) == 1 and all(k in (int, float, type(None)) for k in kinds):
            found[name] = numbers[0]
    return found
