"""How each of DiffSynth-Studio's trainable pipelines is put together for training, as its `train.py` does it.

The part of a DiffSynth training step that lives in its repository's examples rather than in the `diffsynth`
package is small: the dtype the pipeline is built in, the tokenizer folders `from_pretrained` takes (and the model
ids they default to), and how a dataset row becomes the pipeline's inputs. `Glue` declares those per pipeline;
`inputs` builds the three input dicts the way the image pipelines' `get_pipeline_inputs` does. Only pipelines whose
step unitgraph checks against DiffSynth's own in the tests are listed (`GLUES`); the rest of the wheel's pipelines
are named by `not_listed`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Optional

from ..errors import BackendError

__all__ = ["Glue", "GLUES", "glue_for", "inputs"]


@dataclass(frozen=True)
class Tokenizer:
    """A tokenizer folder `from_pretrained` takes: its keyword, the flag that names it, the model id and pattern
    its `train.py` falls back to, and the text encoder (pipeline attribute) it serves: a stage that does not load
    that encoder does not look for the tokenizer."""

    keyword: str
    flag: str
    model_id: str
    pattern: str
    encoder: str = "text_encoder"


@dataclass(frozen=True)
class Glue:
    """One trainable DiffSynth pipeline.

    module / class_name: `diffsynth.pipelines.<module>.<class_name>`. dtype: what its `train.py` builds the pipeline
    in. tokenizers: the tokenizer folders of `from_pretrained`. columns: the metadata columns a sample must have.
    division: the multiple its
    dataset's ImageCropAndResize rounds sides to. example: its folder under DiffSynth's `examples/`.
    """

    module: str
    class_name: str
    title: str
    dtype: str = "bfloat16"
    tokenizers: tuple[Tokenizer, ...] = ()
    columns: tuple[str, ...] = ("image", "prompt")
    division: int = 16
    example: str = ""

    @property
    def name(self) -> str:
        return f"diffsynth:{self.module}"


GLUES: tuple[Glue, ...] = (
    Glue("stable_diffusion", "StableDiffusionPipeline", "Stable Diffusion 1.x (DiffSynth's pipeline)", dtype="float32",
         tokenizers=(Tokenizer("tokenizer_config", "tokenizer_path", "AI-ModelScope/stable-diffusion-v1-5",
                               "tokenizer/"),),
         division=32, example="stable_diffusion"),
    Glue("ideogram4", "Ideogram4Pipeline", "Ideogram 4 (DiffSynth's pipeline; no other trainer has it)",
         tokenizers=(Tokenizer("tokenizer_config", "tokenizer_path", "ideogram-ai/ideogram-4-fp8", "tokenizer/"),),
         example="ideogram4"),
)


def glue_for(name: str) -> Glue:
    """The glue of `diffsynth:MODULE` (or MODULE); one line naming the listed ones for another."""
    module = name.split(":", 1)[1] if name.startswith("diffsynth:") else name
    module = module.split(".", 1)[0]
    for glue in GLUES:
        if glue.module == module:
            return glue
    listed = ", ".join(g.name for g in GLUES)
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


def not_listed(module: str) -> Optional[str]:
    """None when `module` is listed, else the line `glue_for` raises."""
    try:
        glue_for(module)
    except BackendError as exc:
        return str(exc)
    return None
