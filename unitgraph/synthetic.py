"""Synthetic pipelines for benchmarks and scale tests, which check that the planner is linear on any shape
(docs/benchmarks.md, 'Planner scaling').

- `random_pipeline`: DAG-ish preprocessing over a sliding window of params, with a declared sink
  reading the last few params, or, with `declare_sink=False`, no sink at all: the sink then reads
  *every* param (docs/plan-format.md, 'Pipeline spec'), which gives many cache entries and a sink
  read set as large as the param pool, the shape of a pipeline read from DiffSynth-Studio.
- `chain_pipeline`: one long in-place update chain.
- `replicate_pipeline`: real pipelines (say, DiffSynth-Studio's, read by the `diffsynth` adapter)
  copied side by side, round robin, with renamed units and params, up to any number of units.

Every generator is deterministic: the same arguments give the same pipeline.
"""

from __future__ import annotations

import random
from typing import Sequence

from .spec import Pipeline, Sink, Unit


def random_pipeline(
    n_units: int, seed: int = 0, n_params: int | None = None, n_models: int = 8, declare_sink: bool = True
) -> Pipeline:
    """n units over a pool of params; each reads 1-3 recent params and writes 1-2, some in place.

    Params are drawn mostly from a sliding window so the pipeline looks like real preprocessing:
    local dependencies, occasional long-range reads, a few non-deterministic units. With
    `declare_sink` the sink reads the last 8 params and calls `dit`; without it the pipeline
    declares no sink, so the sink reads every param and calls only the models needing backward.
    The units are the same either way (the sink draws no random numbers).
    """
    rng = random.Random(seed)
    n_params = n_params or max(4, n_units // 2)
    window = 12
    units = []
    for i in range(n_units):
        centre = int(i * n_params / max(1, n_units))
        def pick() -> str:
            if rng.random() < 0.1:
                return f"p{rng.randrange(n_params)}"
            return f"p{min(n_params - 1, max(0, centre + rng.randint(-window, 1)))}"
        inputs = sorted({pick() for _ in range(rng.randint(1, 3))})
        outputs = sorted({pick() for _ in range(rng.randint(1, 2))})
        models = [f"m{rng.randrange(n_models)}"] if rng.random() < 0.3 else []
        units.append(Unit(f"u{i}", tuple(inputs), tuple(outputs), tuple(models), deterministic=rng.random() > 0.02))
    if not declare_sink:
        return Pipeline(f"random_nosink_{n_units}", tuple(units), None)
    sink = Sink(inputs=tuple(f"p{k}" for k in range(max(0, n_params - 8), n_params)), models=("dit",))
    return Pipeline(f"random_{n_units}", tuple(units), sink)


def chain_pipeline(n_units: int) -> Pipeline:
    """A long in-place update chain over one param, with a side input every tenth unit.

    A frozen `encoder` is called every hundredth unit and a trainable `adapter` halfway, so with
    B = {adapter} the second half of the chain lands in TRAIN through the update chain.
    """
    units = []
    for i in range(n_units):
        inputs = ("x", f"side{i}") if i % 10 == 0 else ("x",)
        models = ("adapter",) if i == n_units // 2 else (("encoder",) if i % 100 == 0 else ())
        units.append(Unit(f"u{i}", inputs, ("x",), models))
    return Pipeline(f"chain_{n_units}", tuple(units), Sink(inputs=("x",), models=("dit",)))


def replicate_pipeline(templates: Sequence[Pipeline], n_units: int, name: str | None = None) -> Pipeline:
    """Copies of `templates`, side by side, round robin, cut at exactly `n_units` units.

    Copy k of a template renames its units `NAME#k` and its params `PARAM#k`, so copies share no
    param and each is the template's own dependency structure; model names are kept, so training
    `text_encoder` seeds the prompt embedder of every copy, as it would in each real pipeline. The
    sink reads the (renamed) sink inputs of every copy that has units in the result, in order, and
    calls every model their sinks call; a template without a declared sink counts as one reading
    all of its params, so a corpus read from DiffSynth-Studio (whose sinks read every param) gives
    a sink reading every param of the result, the no-sink shape at scale.
    """
    templates = [t for t in templates if t.units]
    if n_units > 0 and not templates:
        raise ValueError("replicate_pipeline needs at least one template with units")
    units: list[Unit] = []
    sink_inputs: dict[str, None] = {}
    sink_models: dict[str, None] = {}
    k = 0
    while len(units) < n_units:
        template = templates[k % len(templates)]
        tag = f"#{k}"
        for unit in template.units[: n_units - len(units)]:
            units.append(Unit(
                name=unit.name + tag,
                inputs=tuple(p + tag for p in unit.inputs),
                outputs=tuple(p + tag for p in unit.outputs),
                models=unit.models,
                deterministic=unit.deterministic,
                requires=tuple(p + tag for p in unit.requires),
                configs=unit.configs,
            ))
        reads = template.sink.inputs if template.sink is not None else template.params
        sink_inputs.update((p + tag, None) for p in reads)
        if template.sink is not None:
            sink_models.update((m, None) for m in template.sink.models)
        k += 1
    sink = Sink(inputs=tuple(sink_inputs), models=tuple(sink_models))
    return Pipeline(name or f"replicated_{n_units}", tuple(units), sink)
