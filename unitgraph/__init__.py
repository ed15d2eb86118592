"""unitgraph: plan, prove and draw split training of diffusion pipelines.

The core is importable without torch. Typical use::

    import unitgraph
    pipeline = unitgraph.load_pipeline("diffusion:qwen_image")
    plan = unitgraph.split(pipeline, trainable_models=(), lora_base_model="dit")
    assert unitgraph.verify(pipeline, plan) == []
"""

from .errors import PlanFileError, SpecError, UnitgraphError
from .graph import VersionGraph
from .plan import split
from .planfile import FORMAT, Plan, read_plan_file
from .references import load_pipeline
from .spec import Pipeline, Sink, Unit, pipeline_from_dict
from .soundness import verify

__version__ = "0.1.0"

__all__ = [
    "FORMAT",
    "Pipeline",
    "Plan",
    "PlanFileError",
    "Sink",
    "SpecError",
    "Unit",
    "UnitgraphError",
    "VersionGraph",
    "load_pipeline",
    "pipeline_from_dict",
    "read_plan_file",
    "split",
    "verify",
]
