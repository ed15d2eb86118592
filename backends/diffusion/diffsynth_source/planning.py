"""The plan of a DiffSynth pipeline: its units as the adapter reads them, each narrowed to the outputs that matter.

The `diffsynth:` adapter turns each unit into a `unitgraph.spec.Unit` whose every output depends on every input. For
DiffSynth's image and video units that is too coarse to split well: the unit that VAE-encodes the training image
(`InputImageEmbedder`) also passes the initial noise through as `latents` (`return {"latents": noise,
"input_latents": encoded}` in training), so it reads the random `noise` and the core, rightly for such a unit, keeps
it and its VAE in stage 2.

Two facts narrow it, both read from the code, not assumed:

- **the loss overwrites `latents`.** `loss_overwrites` reads the task's loss function (DiffSynth's `FlowMatchSFTLoss`):
  a param it assigns (`inputs["latents"] = pipe.scheduler.add_noise(...)`) at its top level before reading it is
  not read from the units, so no unit's write of it reaches the loss;
- **`input_latents` does not depend on `noise`.** The adapter's `output_dependencies` (a may-depend analysis of
  `process`, data and control, with DiffSynth's training flag set as it is while the unit runs) gives each returned
  key the arguments it may depend on.

`live_projection` walks the units from the loss backwards keeping the params still needed, and replaces a unit with
outputs nobody needs by the unit restricted to the others, reading only the arguments those depend on. The core then
plans the narrowed units as usual: the image unit goes to stage 1 with its VAE; the noise unit stays in training
(it draws, and its draw keeps stage 2's stream the unsplit step's). At run time the narrowed unit is DiffSynth's
unit unchanged: the arguments it no longer reads are absent from its inputs (DiffSynth's runner passes None), which
by the analysis changes none of the outputs kept, and the outputs dropped are never read.

A third fact makes a drawing unit deterministic: **noise drawn from the sample's own seed.** DiffSynth's noise units
draw through `pipe.generate_noise(shape, seed=seed, ...)`, which, given a seed, draws from a generator of its own
seeded with it and leaves torch's global stream alone. When the sample's inputs give `seed` (a direct-distill
dataset's column), `seeded_units` names the units whose only draws are such calls with their own `seed` argument:
the noise is then a function of the sample, computed once in stage 1 with the VAE encoding that passes it on. Stage
1's checks still watch the global stream (hazards.py), and a row without a seed is refused before its units run.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
from dataclasses import replace
from typing import Any, Callable

from unitgraph.spec import Pipeline, Sink

__all__ = ["live_projection", "loss_overwrites", "seeded_units"]


def loss_overwrites(loss: Callable[..., Any], name: str = "inputs", present: frozenset[str] = frozenset()) -> frozenset[str]:
    """Params the loss `loss(pipe, **inputs)` assigns at its top level before any read of them; with `present` (params
    every sample's state holds), also those it assigns in a top-level `if inputs.get(P) is not None:` or `if P in
    inputs:` of such a param (a branch every step takes: MOVA's loss noises the sound's latents when they are there).

    >>> def loss(pipe, **inputs):
    ...     t = inputs.get("max_timestep_boundary", 1)
    ...     inputs["latents"] = pipe.add_noise(inputs["input_latents"], t)
    ...     if inputs.get("sound") is not None:
    ...         inputs["sound_latents"] = pipe.add_noise(inputs["sound"], t)
    ...     return pipe.model_fn(**inputs)
    >>> sorted(loss_overwrites(loss)), sorted(loss_overwrites(loss, present=frozenset({"sound"})))
    (['latents'], ['latents', 'sound_latents'])
    """
    tree = ast.parse(textwrap.dedent(inspect.getsource(loss)))
    func = next(n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)))
    read: set[str] = set()
    written: set[str] = set()

    def key(node: ast.AST) -> str | None:
        if (isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name) and node.value.id == name
                and isinstance(node.slice, ast.Constant) and isinstance(node.slice.value, str)):
            return node.slice.value
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get"
                and isinstance(node.func.value, ast.Name) and node.func.value.id == name and node.args
                and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            return node.args[0].value
        if (isinstance(node, ast.Compare) and len(node.ops) == 1 and isinstance(node.ops[0], (ast.In, ast.NotIn))
                and isinstance(node.comparators[0], ast.Name) and node.comparators[0].id == name
                and isinstance(node.left, ast.Constant) and isinstance(node.left.value, str)):
            return node.left.value
        return None

    def reads_of(node: ast.AST) -> set[str]:
        found = {key(n) for n in ast.walk(node)} - {None}
        if any(isinstance(n, ast.Name) and n.id == name and not _subscripted(node, n) for n in ast.walk(node)):
            found.add("*")  # the whole dict handed on (model_fn(**inputs)): every param read from here on
        return found  # type: ignore[return-value]

    def taken(stmt: ast.AST) -> bool:  # an `if` on a present param, without an else
        if not isinstance(stmt, ast.If) or stmt.orelse:
            return False
        test = stmt.test
        if (isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ast.IsNot)
                and isinstance(test.comparators[0], ast.Constant) and test.comparators[0].value is None):
            test = test.left
        return (isinstance(test, (ast.Call, ast.Compare)) and key(test) in present
                and not (isinstance(test, ast.Compare) and isinstance(test.ops[0], ast.NotIn)))

    body = []
    for stmt in func.body:
        body.extend(stmt.body if taken(stmt) else [stmt])
    for stmt in body:
        if (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and key(stmt.targets[0]) is not None):
            read |= reads_of(stmt.value)
            target = key(stmt.targets[0])
            if target not in read and "*" not in read:
                written.add(target)  # type: ignore[arg-type]
            continue
        read |= reads_of(stmt)
        if "*" in read:
            break
    return frozenset(written)


def _subscripted(tree: ast.AST, name_node: ast.Name) -> bool:
    """Whether `name_node` is the dict of a subscript, a `.get(...)` or an `in` test (a read of one key)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Subscript) and node.value is name_node:
            return True
        if isinstance(node, ast.Attribute) and node.value is name_node and node.attr == "get":
            return True
        if isinstance(node, ast.Compare) and name_node in node.comparators:
            return True
    return False


def live_projection(spec: Pipeline, decls: list[Any], dead: frozenset[str]) -> tuple[Pipeline, dict[str, str]]:
    """`spec` with each plain unit (not take-over, not split positive/negative) narrowed to its outputs still needed,
    reading only the arguments they depend on (`decls`: the adapter's declarations, their `output_deps`); `dead`: the
    params the loss overwrites. Returns the narrowed pipeline and a line per narrowed unit saying what it dropped."""
    sink_inputs = tuple(p for p in (spec.sink.inputs if spec.sink else ()) if p not in dead)
    live = set(sink_inputs) if spec.sink else set().union(*(set(u.inputs) | set(u.outputs) for u in spec.units)) - dead
    narrowed = []
    notes: dict[str, str] = {}
    for unit, decl in reversed(list(zip(spec.units, decls))):
        facts = getattr(decl, "process", None)
        deps = getattr(facts, "output_deps", None)
        plain = not decl.fields.get("take_over") and not decl.fields.get("seperate_cfg")
        kept = [o for o in unit.outputs if o in live]
        if plain and deps is not None and kept and len(kept) < len(unit.outputs) and all(o in deps for o in unit.outputs):
            reads = set().union(*(deps[o] for o in kept))
            inputs = tuple(p for p in unit.inputs if p in reads)
            dropped = [o for o in unit.outputs if o not in kept]
            unread = [p for p in unit.inputs if p not in reads]
            notes[unit.name] = (f"{unit.name}: planned for {', '.join(kept)} only ({', '.join(dropped)}, which nothing "
                                f"after it reads, dropped{'; ' + ', '.join(unread) + ' not read for it' if unread else ''})")
            unit = replace(unit, inputs=inputs, outputs=tuple(kept), requires=tuple(r for r in unit.requires if r in reads))
        narrowed.append(unit)
        live |= set(unit.inputs)
    sink = Sink(inputs=sink_inputs, models=spec.sink.models) if spec.sink else None
    return Pipeline(spec.name, tuple(reversed(narrowed)), sink, source=spec.source), notes


def seeded_units(units: list[Any], given: frozenset[str]) -> list[str]:
    """Class names of `units` whose class draws only seeded noise (`draws_only_seeded_noise`), when the sample's
    inputs give `seed` (`given`); none otherwise. A unit whose source cannot be read stays as the adapter reads it."""
    if "seed" not in given:
        return []
    found = []
    for unit in units:
        try:
            source = inspect.getsource(type(unit))
        except (OSError, TypeError):
            continue
        if draws_only_seeded_noise(source):
            found.append(type(unit).__name__)
    return found


def draws_only_seeded_noise(source: str) -> bool:
    """Whether a unit class (its source) draws, and every draw anywhere in it is `pipe.generate_noise(...,
    seed=seed)` with `seed` an argument of its `process`. Any other draw (`torch.randn`, a noise call without that
    seed) leaves it drawing.

    >>> draws_only_seeded_noise('''
    ... class Noise:
    ...     def process(self, pipe, height, seed, rand_device):
    ...         return {"noise": pipe.generate_noise((1, height), seed=seed, rand_device=rand_device)}
    ... ''')
    True
    >>> draws_only_seeded_noise('''
    ... class Jitter:
    ...     def process(self, pipe, seed):
    ...         return {"x": pipe.generate_noise((1,), seed=seed) + torch.randn(1)}
    ... ''')
    False
    """
    from unitgraph.adapters.diffsynth import RANDOM_CALLS

    try:
        tree = ast.parse(textwrap.dedent(source))
    except SyntaxError:
        return False
    process = next((n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "process"), None)
    if process is None or "seed" not in {a.arg for a in process.args.args + process.args.kwonlyargs}:
        return False
    draws = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and _called(n) in RANDOM_CALLS]
    return bool(draws) and all(_called(n) == "generate_noise" and any(
        k.arg == "seed" and isinstance(k.value, ast.Name) and k.value.id == "seed" for k in n.keywords)
        for n in draws)


def _called(call: ast.Call) -> str:
    func = call.func
    return func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
