"""Synthetic pipelines for benchmarks and scale tests: random DAG-ish pipelines and long update chains."""

from __future__ import annotations

import random

from .spec import Pipeline, Sink, Unit


def random_pipeline(n_units: int, seed: int = 0, n_params: int | None = None, n_models: int = 8) -> Pipeline:
    """n units over a pool of params; each reads 1-3 recent params and writes 1-2, some in place.

    Params are drawn mostly from a sliding window so the pipeline looks like real preprocessing:
    local dependencies, occasional long-range reads, a few non-deterministic units.
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
