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

from typing import Any, Mapping

from ..errors import BackendError
from ..family import DiffSynthPipeline, DiffSynthTokenizer

__all__ = ["Glue", "OWN", "Tokenizer", "glue_for", "glues", "inputs"]


Glue = DiffSynthPipeline
Tokenizer = DiffSynthTokenizer

# DiffSynth's pipelines of no family of unitgraph's; a family's own are in its folder (`Family.diffsynth`)
OWN: tuple[Glue, ...] = (
    Glue("ideogram4", "Ideogram4Pipeline", "Ideogram 4 (DiffSynth's pipeline; no other trainer has it)",
         tokenizers=(Tokenizer("tokenizer_config", "tokenizer_path", "ideogram-ai/ideogram-4-fp8", "tokenizer/"),),
         example="ideogram4"),
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
           gradient_checkpointing_offload: bool, extra_inputs: tuple[str, ...] = ()) -> tuple[dict, dict, dict]:
    """(inputs_shared, inputs_posi, inputs_nega) of one sample, as the image pipelines' `get_pipeline_inputs` builds
    them: the image and its size, `cfg_scale` 1, the pipeline's device as `rand_device`, the gradient checkpointing
    flags, and each --extra_inputs column by its own name."""
    image = sample["image"]
    shared: dict[str, Any] = {
        "input_image": image,
        "height": image.size[1],
        "width": image.size[0],
        "cfg_scale": 1,
        "rand_device": device,
        "use_gradient_checkpointing": gradient_checkpointing,
        "use_gradient_checkpointing_offload": gradient_checkpointing_offload,
    }
    for name in extra_inputs:
        if name.startswith(("controlnet_", "blockwise_controlnet_")):
            raise BackendError(f"--extra_inputs {name}: ControlNet inputs are not trained through DiffSynth's own "
                               "pipelines yet")
        shared[name] = sample.get(name)
    return shared, {"prompt": sample["prompt"]}, {"negative_prompt": ""}
