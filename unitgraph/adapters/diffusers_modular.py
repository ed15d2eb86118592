"""diffusers Modular Pipelines as unitgraph pipelines (`diffusers:` references).

`unitgraph plan diffusers:QwenImageAutoBlocks` names any `ModularPipelineBlocks` class exported by
diffusers; `diffusers:my_pkg.blocks:MyBlocks` a class of the user's own (with `--source DIR` added
to the import path); `diffusers:./path/to/folder` a saved modular pipeline (its `modular_config.json`
names a blocks class in a module file of the folder, its `modular_model_index.json` a diffusers
blocks class). The blocks are instantiated, nothing more: no component is created or loaded and
nothing is downloaded. diffusers is imported when a reference is resolved, not when this module is.

What is resolved how, and what runs (docs/adapters.md, 'What runs'):

- a bare name (no `/` or `\\`, not starting with `.`, no `:`) is always a class of diffusers itself,
  never a folder, even when a folder of that name is in the current directory;
- a folder is read only when the reference is written as a path (`./MyBlocks`, `/abs/path`); its
  `modular_model_index.json` names a diffusers class (nothing of the folder runs), its
  `modular_config.json` names custom code, imported only with `trust_remote_code=True` (and not
  when diffusers' DIFFUSERS_DISABLE_REMOTE_CODE is set, as diffusers' own `from_pretrained` does);
- `module:Class` is imported when the module's top-level package is installed code (the standard
  library, site-packages, an editable install); found anywhere else (`--source`, the current
  directory, PYTHONPATH) it is imported only with `trust_remote_code=True`. So is diffusers itself.

The mapping (docs/adapters.md explains each decision):

- units: the leaf blocks in execution order, named by their block path (`vae_encoder.img2img.encode`),
  sequential blocks flattened; a loop block (`LoopSequentialPipelineBlocks`) is one unit, because
  its body blocks pass values to each other through the loop's block state without declaring them;
- inputs: the block's `inputs` (a `kwargs_type` input such as `denoiser_input_fields` stands for
  every param earlier blocks output with that kwargs type); outputs: `intermediate_outputs`, plus
  every declared input the block's code assigns on `block_state` (diffusers writes a changed input
  back to the state even when it is not declared as an output);
- models: the `expected_components` that hold weights (type hint a `torch.nn.Module`; without a
  type hint, components created `from_pretrained`); tokenizers, schedulers, processors and guiders
  are configuration, not models;
- conditional and auto blocks: with `--with`, resolved as diffusers resolves them
  (`select_block` on the trigger inputs present, the provided params and the outputs of the
  blocks resolved so far); without, the union of their branches, every branch unit modelled as
  possibly writing its outputs (it also reads them), so the split is sound whichever branch runs;
- deterministic: false when the block's class (or a module-level helper it calls) draws random
  numbers (`randn_tensor`, `torch.randn`, ...), when it samples a VAE posterior
  (`sample_mode="sample"`), or when the class is listed in KNOWN_NONDETERMINISTIC; overridable;
- the sink: training runs the denoiser once where inference runs the denoise loop, so the first
  block that uses a denoiser component (`transformer`, `unet`, ...) becomes the sink: it reads that
  block's inputs (plus the loss's own inputs, LOSS_INPUTS, when a unit writes them) and calls its
  models. The blocks after it (after-denoise, decode) are inference only and left out.
"""

from __future__ import annotations

import ast
import difflib
import hashlib
import importlib
import importlib.util
import inspect
import json
import sys
import textwrap
from functools import lru_cache
from pathlib import Path
from typing import Any, Iterable

from ..errors import SpecError
from ..spec import Pipeline, Sink, Unit
from . import note, refuse_untrusted, short_list, untrusted_location

# components whose block is the training sink (the model the loss runs)
DENOISER_COMPONENTS = ("transformer", "transformer_2", "unet", "denoiser")
# params the loss reads besides the denoiser block's inputs: the clean target and the noise
LOSS_INPUTS = ("image_latents", "initial_noise")
# calls that draw random numbers, looked for in a block's class and the module helpers it calls
RANDOM_CALLS = frozenset({
    "randn_tensor", "randn", "rand", "randint", "randn_like", "rand_like", "randint_like", "randperm",
    "normal", "normal_", "uniform_", "bernoulli", "multinomial", "poisson", "choice", "shuffle",
})
# known classes whose randomness the code scan cannot see (VAE posterior sampled by a shared helper)
KNOWN_NONDETERMINISTIC = frozenset({"StableDiffusionXLVaeEncoderStep", "StableDiffusionXLInpaintVaeEncoderStep"})
KNOWN_DETERMINISTIC: frozenset[str] = frozenset()

_UNION = object()


def resolve(name: str, *, provided: Iterable[str] | None = None, source: str | None = None,
            trust_remote_code: bool = False) -> Pipeline:
    """The pipeline of `diffusers:NAME` (the `unitgraph.backends` entry point `diffusers`)."""
    where = f"diffusers:{name}"
    blocks = load_blocks(name, source=source, where=where, trust_remote_code=trust_remote_code)
    return blocks_to_pipeline(blocks, provided=provided, source=where)


# --- finding the blocks ---------------------------------------------------------------------------


def is_path_reference(name: str) -> bool:
    """A reference written as a path (a saved folder); anything else never reads the filesystem."""
    return "/" in name or "\\" in name or name.startswith(".")


def _modular(where: str, trust_remote_code: bool = False):
    if "diffusers" not in sys.modules:
        place = untrusted_location("diffusers")
        if place is not None and not trust_remote_code:
            raise refuse_untrusted(f"importing diffusers would run code from {place}, which is not an installed "
                                   f"package", where)
    try:
        import diffusers  # noqa: F401  (the import that takes seconds: torch comes with it)
        from diffusers import modular_pipelines
    except ImportError as exc:
        raise SpecError(f"diffusers with Modular Pipelines is not installed ({exc}); pip install 'diffusers>=0.35'",
                        source=where) from None
    return modular_pipelines


def load_blocks(name: str, source: str | None = None, where: str | None = None, *,
                trust_remote_code: bool = False) -> Any:
    """A `ModularPipelineBlocks` instance for a class name, `module:Class`, or a saved folder (a path).

    Code that is not installed (a folder's custom blocks, a module found outside installed packages)
    runs only with `trust_remote_code=True`; without it a SpecError says what would run.
    """
    where = where or f"diffusers:{name}"
    mp = _modular(where, trust_remote_code)
    if is_path_reference(name):
        folder = Path(name)
        if not folder.is_dir():
            raise SpecError("no such folder (a saved modular pipeline folder was expected)", source=where)
        obj = _from_folder(folder, mp, where, trust_remote_code)
    elif ":" in name:
        module_name, _, attr = name.rpartition(":")
        module = _import_user_module(module_name, source, where, trust_remote_code)
        obj = getattr(module, attr, None)
        if obj is None:
            raise SpecError(f"module {module_name!r} has no attribute {attr!r}", source=where)
    else:
        if source is not None:
            raise SpecError("--source is for `module:Class` references (the folder to import the module from)",
                            source=where)
        obj = _diffusers_class(name, mp, where)
        if Path(name).is_dir():
            note(f"diffusers: {name} is diffusers' class; the folder {name} in the current directory is not read "
                 f"(write diffusers:./{name} to read it)")
    return _instantiate(obj, mp, where)


def _diffusers_class(name: str, mp, where: str) -> Any:
    import diffusers

    for namespace in (mp, diffusers):
        obj = getattr(namespace, name, None)
        if obj is not None:
            return obj
    known = [n for n in dir(mp) if n.endswith(("Blocks", "Step"))]
    close = difflib.get_close_matches(name, known, n=3)
    hint = f"; did you mean {', '.join(close)}?" if close else " (blocks classes look like QwenImageAutoBlocks)"
    if Path(name).is_dir():
        hint += f"; for the folder {name} in the current directory write diffusers:./{name}"
    raise SpecError(f"diffusers {diffusers.__version__} has no modular blocks class {name!r}{hint}", source=where)


def _import_user_module(module_name: str, source: str | None, where: str, trust_remote_code: bool = False):
    added = False
    if source is not None:
        if not Path(source).is_dir():
            raise SpecError(f"--source {source!r} is not a folder", source=where)
        path = str(Path(source).resolve())
        if path not in sys.path:
            sys.path.insert(0, path)
            added = True
    try:
        place = untrusted_location(module_name)  # located, not imported
        if place is not None and not trust_remote_code:
            raise refuse_untrusted(f"importing {module_name!r} would run code from {place}, which is not an "
                                   f"installed package", where)
        return importlib.import_module(module_name)
    except ImportError as exc:
        hint = "" if source else " (pass --source DIR to import it from a folder)"
        raise SpecError(f"cannot import {module_name!r}: {exc}{hint}", source=where) from None
    finally:
        if added:
            sys.path.remove(str(Path(source).resolve()))


def _from_folder(folder: Path, mp, where: str, trust_remote_code: bool = False) -> Any:
    """The blocks of a saved folder: custom code named by modular_config.json (imported only when
    trusted, as diffusers' `from_pretrained(..., trust_remote_code=...)` would), else the index's class."""
    config = folder / "modular_config.json"
    index = folder / "modular_model_index.json"
    if config.is_file():
        data = _read_json(config, where)
        auto_map = data.get("auto_map") if isinstance(data, dict) else None
        if not isinstance(auto_map, dict) or not auto_map:
            raise SpecError(f"{config.name} has no auto_map naming the blocks class", source=where)
        ref = auto_map.get("ModularPipelineBlocks") or next(iter(auto_map.values()))
        module_file, _, class_name = str(ref).rpartition(".")
        path = folder / f"{module_file}.py"
        if path.resolve().parent != folder.resolve():
            raise SpecError(f"{config.name} names {ref!r}, a module outside the folder", source=where)
        if not path.is_file():
            raise SpecError(f"{config.name} names {ref!r} but {path.name} is not in the folder", source=where)
        what = f"reading the folder {folder} would run its custom code {path} ({config.name} names {ref!r})"
        if not trust_remote_code:
            raise refuse_untrusted(what, where)
        if _remote_code_disabled():
            raise SpecError(f"{what}, and diffusers' DIFFUSERS_DISABLE_REMOTE_CODE forbids it", source=where)
        module = _import_file(path, where)
        obj = getattr(module, class_name, None)
        if obj is None:
            raise SpecError(f"{path.name} defines no {class_name!r}", source=where)
        return obj
    if index.is_file():
        data = _read_json(index, where)
        class_name = data.get("_blocks_class_name") if isinstance(data, dict) else None
        if not isinstance(class_name, str):
            raise SpecError(f"{index.name} names no _blocks_class_name", source=where)
        return _diffusers_class(class_name, mp, where)
    raise SpecError("not a saved modular pipeline: neither modular_config.json nor modular_model_index.json",
                    source=where)


def _remote_code_disabled() -> bool:
    """diffusers' switch (an environment variable) that turns trust_remote_code off everywhere."""
    try:
        from diffusers.utils import constants
    except ImportError:  # pragma: no cover
        return False
    return bool(getattr(constants, "DIFFUSERS_DISABLE_REMOTE_CODE", False))


def _read_json(path: Path, where: str) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise SpecError(f"cannot read {path.name}: {exc}", source=where) from None


def _import_file(path: Path, where: str):
    """Import a block module file of a saved folder (its code runs: only called when trusted)."""
    digest = hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:12]
    module_name = f"unitgraph_diffusers_blocks_{path.stem}_{digest}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # inspect.getsource needs it there
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        del sys.modules[module_name]
        raise SpecError(f"importing {path.name} failed: {type(exc).__name__}: {exc}", source=where) from None
    return module


def _instantiate(obj: Any, mp, where: str) -> Any:
    base = mp.ModularPipelineBlocks
    if isinstance(obj, base):
        return obj
    blocks = getattr(obj, "blocks", None)  # a ModularPipeline
    if isinstance(blocks, base):
        return blocks
    if inspect.isclass(obj) and issubclass(obj, base):
        try:
            return obj()
        except Exception as exc:
            raise SpecError(f"{obj.__name__}() failed: {type(exc).__name__}: {exc}", source=where) from None
    raise SpecError(f"{getattr(obj, '__name__', type(obj).__name__)} is not a ModularPipelineBlocks class", source=where)


# --- the mapping ----------------------------------------------------------------------------------


def blocks_to_pipeline(
    blocks: Any,
    *,
    provided: Iterable[str] | None = None,
    name: str | None = None,
    source: str = "<diffusers>",
    denoisers: Iterable[str] = DENOISER_COMPONENTS,
    loss_inputs: Iterable[str] = LOSS_INPUTS,
    deterministic: Iterable[str] = (),
    nondeterministic: Iterable[str] = (),
) -> Pipeline:
    """Flatten a `ModularPipelineBlocks` instance into a Pipeline (see the module docstring).

    `deterministic` / `nondeterministic` override the determinism rule for the units (block paths)
    or block class names they list. Notes on the choices made are issued as `AdapterNote` warnings.
    """
    mp = _modular(source)
    walker = _Flattener(mp, provided, frozenset(denoisers), frozenset(deterministic), frozenset(nondeterministic))
    walker.walk(blocks, "", maybe=False)
    units = walker.units
    sink = None
    if walker.denoiser_paths:
        written = {p for u in units for p in u.outputs}
        extra = [p for p in loss_inputs if p in written and p not in walker.sink_inputs]
        sink = Sink(inputs=(*walker.sink_inputs, *extra), models=tuple(walker.sink_models))
    walker.report(type(blocks).__name__)
    return Pipeline(name or type(blocks).__name__, tuple(units), sink, source=source)


class _Flattener:
    """One walk over a blocks tree, in execution order, collecting units, the sink and notes."""

    def __init__(self, mp, provided, denoisers, deterministic, nondeterministic):
        self.mp = mp
        self.available: set[str] | None = None if provided is None else set(provided)
        self.provided = None if provided is None else sorted(set(provided))
        self.denoisers = denoisers
        self.force_deterministic = deterministic
        self.force_random = nondeterministic
        self.groups: dict[str, dict[str, None]] = {}  # kwargs_type -> param names
        self.units: list[Unit] = []
        self.sink_inputs: dict[str, None] = {}
        self.sink_models: dict[str, None] = {}
        self.denoiser_paths: list[str] = []
        self.unions: list[str] = []
        self.triggers: set[str] = set()
        self.skipped: list[str] = []
        self.fallbacks: list[str] = []
        self.dropped: list[str] = []
        self.inplace: list[str] = []
        try:
            import torch

            self.module_class = torch.nn.Module
        except ImportError:  # pragma: no cover - diffusers needs torch
            self.module_class = None

    # --- the tree -------------------------------------------------------------------------------

    def walk(self, block: Any, path: str, maybe: bool) -> bool:
        """Add the units of `block`; True when it contains the denoiser (the walk stops after it)."""
        mp = self.mp
        if isinstance(block, mp.ConditionalPipelineBlocks):
            self.triggers.update(t for t in (block.block_trigger_inputs or []) if isinstance(t, str))
            choice = self._select(block, path) if self.available is not None else _UNION
            if choice is None:
                self.skipped.append(path or type(block).__name__)
                return False
            if choice is not _UNION:
                return self.walk(block.sub_blocks[choice], _join(path, choice), maybe)
            self.unions.append(path or type(block).__name__)
            hit = False
            for child_name, child in block.sub_blocks.items():
                hit = self.walk(child, _join(path, child_name), True) or hit
            return hit
        if block.sub_blocks and not isinstance(block, mp.LoopSequentialPipelineBlocks):
            children = list(block.sub_blocks.items())
            for k, (child_name, child) in enumerate(children):
                if self.walk(child, _join(path, child_name), maybe):
                    self.dropped += [_join(path, rest) for rest, _ in children[k + 1:]]
                    return True
            return False
        return self._leaf(block, path or type(block).__name__, maybe)

    def _select(self, block: Any, path: str) -> Any:
        """The branch diffusers would run for the params available here (None: the block is skipped)."""
        triggers = [t for t in (block.block_trigger_inputs or []) if isinstance(t, str)]
        present = {t: (True if t in self.available else None) for t in triggers}
        try:
            chosen = block.select_block(**present)
        except Exception as exc:  # a select_block that looks at values, not presence
            self.fallbacks.append(f"{path or type(block).__name__} ({type(exc).__name__})")
            return _UNION
        if chosen is None:
            chosen = block.default_block_name
        if chosen is not None and chosen not in block.sub_blocks:
            self.fallbacks.append(f"{path} (selected unknown branch {chosen!r})")
            return _UNION
        return chosen

    # --- one unit -------------------------------------------------------------------------------

    def _leaf(self, block: Any, path: str, maybe: bool) -> bool:
        inputs = self._inputs(block)
        components = list(block.expected_components)
        models = [c.name for c in components if c.name and self._is_model(c)]
        if any(c.name in self.denoisers for c in components):
            self.denoiser_paths.append(path)
            self.sink_inputs.update(dict.fromkeys(inputs))
            self.sink_models.update(dict.fromkeys(models))
            return True
        outputs: dict[str, None] = {}
        for out in block.intermediate_outputs:
            if out.name:
                outputs[out.name] = None
                if out.kwargs_type:
                    self.groups.setdefault(out.kwargs_type, {})[out.name] = None
        assigned = _code_facts_of(block, self.mp)[0]
        undeclared = [p for p in inputs if p in assigned and p not in outputs]
        if undeclared:
            self.inplace.append(f"{path} ({', '.join(undeclared)})")
            outputs.update(dict.fromkeys(undeclared))
        if maybe:  # a branch that may not run: its outputs may keep their earlier versions
            inputs = list(dict.fromkeys((*inputs, *outputs)))
        self.units.append(Unit(path, tuple(inputs), tuple(outputs), tuple(dict.fromkeys(models)),
                               deterministic=self._deterministic(block, path)))
        if self.available is not None:
            self.available.update(outputs)
        return False

    def _inputs(self, block: Any) -> list[str]:
        names: dict[str, None] = {}
        for param in block.inputs:
            if param.name:
                names[param.name] = None
                if param.kwargs_type:
                    self.groups.setdefault(param.kwargs_type, {})[param.name] = None
            elif param.kwargs_type:
                names.update(self.groups.get(param.kwargs_type, {}))
        return list(names)

    def _is_model(self, spec: Any) -> bool:
        hint = getattr(spec, "type_hint", None)
        if inspect.isclass(hint):
            return self.module_class is not None and issubclass(hint, self.module_class)
        return getattr(spec, "default_creation_method", "from_pretrained") == "from_pretrained"

    def _deterministic(self, block: Any, path: str) -> bool:
        cls_name = type(block).__name__
        if path in self.force_random or cls_name in self.force_random:
            return False
        if path in self.force_deterministic or cls_name in self.force_deterministic:
            return True
        if cls_name in KNOWN_NONDETERMINISTIC:
            return False
        if cls_name in KNOWN_DETERMINISTIC:
            return True
        if getattr(block, "sample_mode", None) == "sample":
            return False
        draws = _code_facts_of(block, self.mp)[1]
        if draws is None:  # no source to read: a block that takes a generator is assumed to use it
            return "generator" not in {p.name for p in block.inputs}
        return not draws

    # --- notes ----------------------------------------------------------------------------------

    def report(self, root: str) -> None:
        if self.provided is None and self.unions:
            triggers = ", ".join(sorted(self.triggers))
            note(f"diffusers: no --with given, so the {len(self.unions)} conditional blocks ({short_list(self.unions)}) "
                 f"are the union of their branches, each branch unit possibly writing its outputs (sound for any "
                 f"branch, maybe larger than needed); pass --with (trigger inputs: {triggers}) to pick the branches a run takes")
        elif self.provided is not None and self.skipped:
            note(f"diffusers: for --with {','.join(self.provided)} these conditional blocks do not run: {short_list(self.skipped)}")
        if self.fallbacks:
            note(f"diffusers: could not resolve {short_list(self.fallbacks)} from the params present; took the union "
                 f"of their branches")
        if self.denoiser_paths:
            models = ", ".join(self.sink_models) or "none"
            dropped = f"; the blocks after it are inference only and left out: {short_list(self.dropped)}" if self.dropped else ""
            note(f"diffusers: the sink (the loss) is the denoiser block {short_list(self.denoiser_paths, 3)} "
                 f"(models {models}){dropped}")
        else:
            names = ", ".join(sorted(self.denoisers))
            note(f"diffusers: no block of {root} uses a denoiser component ({names}); the sink reads every param "
                 f"and calls the models that need backward")
        if self.inplace:
            note(f"diffusers: blocks that assign declared inputs on block_state write them back (taken as outputs): "
                 f"{short_list(self.inplace, 4)}")


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


# --- reading block code ---------------------------------------------------------------------------


def _code_facts_of(block: Any, mp) -> tuple[frozenset[str], bool | None]:
    """(names assigned on block_state, draws random numbers?) for a block; loops include their body."""
    classes = [type(block)]
    if isinstance(block, mp.LoopSequentialPipelineBlocks):
        classes += [type(b) for b in block.sub_blocks.values()]
    assigned: set[str] = set()
    draws: bool | None = False
    for cls in classes:
        names, random = _class_facts(cls)
        assigned |= names
        if random is None:
            draws = None if draws is False else draws
        elif random:
            draws = True
    return frozenset(assigned), draws


@lru_cache(maxsize=None)
def _class_facts(cls: type) -> tuple[frozenset[str], bool | None]:
    """Scan a class's source (and module helpers it calls by name, one level): None when unreadable."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError, SyntaxError, IndentationError):
        return frozenset(), None
    assigned, calls = _scan(tree)
    module = sys.modules.get(cls.__module__)
    for name in list(calls):
        helper = getattr(module, name, None) if module is not None else None
        if inspect.isfunction(helper):
            try:
                calls |= _scan(ast.parse(textwrap.dedent(inspect.getsource(helper))))[1]
            except (OSError, TypeError, SyntaxError):
                pass
    return frozenset(assigned), bool(calls & RANDOM_CALLS)


def _scan(tree: ast.AST) -> tuple[set[str], set[str]]:
    assigned: set[str] = set()
    calls: set[str] = set()
    for node in ast.walk(tree):
        targets: list[ast.AST] = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        for target in targets:
            for sub in ast.walk(target):
                if isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Name) and sub.value.id == "block_state":
                    assigned.add(sub.attr)
        if isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            if name:
                calls.add(name)
            if (name == "setattr" and len(node.args) >= 2 and isinstance(node.args[0], ast.Name)
                    and node.args[0].id == "block_state" and isinstance(node.args[1], ast.Constant)
                    and isinstance(node.args[1].value, str)):
                assigned.add(node.args[1].value)
    return assigned, calls


PIPELINES: dict = {}  # open-ended names: `resolve` answers every reference

__all__ = ["DENOISER_COMPONENTS", "KNOWN_NONDETERMINISTIC", "LOSS_INPUTS", "blocks_to_pipeline", "load_blocks", "resolve"]
