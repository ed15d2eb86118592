"""DiffSynth-Studio pipelines as unitgraph pipelines (`diffsynth:` references).

`unitgraph plan diffsynth:qwen_image.QwenImagePipeline` reads the units of
`diffsynth/pipelines/qwen_image.py` without loading any model:

- with `--source PATH` (a DiffSynth-Studio checkout, its `diffsynth` package folder or its
  `pipelines` folder), statically: the module is parsed, never imported, so neither DiffSynth-Studio
  nor torch needs to be installed;
- without it, through the installed `diffsynth` package: the pipeline class is instantiated on the
  CPU (that creates the unit objects and a scheduler, no model) and the units' declarations are
  read from the objects; unit code is still read as source. A `diffsynth` package that is not
  installed code (found in the current directory or on PYTHONPATH, say) is imported only with
  `trust_remote_code=True`; `--source` reads it without running it.

The mapping (docs/adapters.md explains each decision):

- a unit per entry of the pipeline's `self.units`, in order, named by its class without the
  pipeline's common `XxxUnit_` prefix;
- inputs: `input_params` plus the state names of `input_params_posi` / `input_params_nega`
  (positive and negative sides share one namespace here, as they do in DiffSynth's own split);
  a `take_over` unit also reads what its code reads from `inputs_shared` / `inputs_posi` / `inputs_nega`;
- outputs: `output_params` plus the keys of the dicts `process` returns (DiffSynth's runner writes
  those whatever is declared); a `take_over` unit also writes what its code stores in the dicts;
- models: `onload_model_names`; deterministic: false when `process` (or a method of the unit it
  calls) draws random numbers (`pipe.generate_noise`, `torch.randn`, ...);
- requires: the inputs whose absence makes `process` return nothing (`if edit_image is None:
  return {}`, for a take-over unit `return inputs_shared, inputs_posi, inputs_nega` unchanged);
- the sink: DiffSynth hands every param to `model_fn` and the loss, so the sink reads every param
  and calls the pipeline's `in_iteration_models`.

Declaration mistakes that change DiffSynth's own behaviour are reported as `DeclarationWarning`:
a bare string where a one-element tuple was meant (`("vae")` is the string "vae": DiffSynth iterates
its characters, and tests a model name against it as a substring), and outputs `process` returns
but `output_params` does not declare (DiffSynth's split cannot see those writes). The pipeline
built here follows what the code means (the tuple the string stood for, the outputs it returns).
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
import re
import textwrap
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

from ..errors import SpecError
from ..spec import Pipeline, Sink, Unit
from . import declaration_warning, note, refuse_untrusted, short_list, untrusted_location

# PipelineUnit.__init__ parameters, in order (positional arguments map onto them)
FIELDS = ("seperate_cfg", "take_over", "input_params", "output_params", "input_params_posi", "input_params_nega",
          "onload_model_names")
TUPLE_FIELDS = ("input_params", "output_params", "onload_model_names")
DICT_FIELDS = ("input_params_posi", "input_params_nega")
RANDOM_CALLS = frozenset({
    "generate_noise", "randn_tensor", "randn", "rand", "randint", "randn_like", "rand_like", "randint_like",
    "randperm", "normal", "normal_", "uniform_", "bernoulli", "multinomial", "poisson", "choice", "shuffle",
    "random", "uniform", "sample",
})


def resolve(name: str, *, provided: Iterable[str] | None = None, source: str | None = None,
            trust_remote_code: bool = False) -> Pipeline:
    """The pipeline of `diffsynth:MODULE.Class` (the `unitgraph.backends` entry point `diffsynth`).

    With `source`, read statically (nothing runs); else imported from the installed package, which
    must be installed code unless `trust_remote_code`.
    """
    where = f"diffsynth:{name}"
    module_name, class_name = _split_name(name, where)
    if source is not None:
        return from_source(source, module_name, class_name, where=where)
    if importlib.util.find_spec("diffsynth") is None:
        raise SpecError("DiffSynth-Studio is not installed; pass --source PATH (a DiffSynth-Studio checkout) "
                        "to read the pipeline from its source", source=where)
    return from_installed(module_name, class_name, where=where, trust_remote_code=trust_remote_code)


def _split_name(name: str, where: str) -> tuple[str, str | None]:
    name = re.sub(r"^(diffsynth\.)?pipelines\.", "", name.strip())
    if not re.fullmatch(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)?", name):
        raise SpecError("expected MODULE.Class, e.g. diffsynth:qwen_image.QwenImagePipeline", source=where)
    module_name, _, class_name = name.partition(".")
    return module_name, class_name or None


# --- what one unit declares ------------------------------------------------------------------------


@dataclass
class ProcessFacts:
    """What `process` does, read from its source."""

    guards: list[str] = field(default_factory=list)  # params whose absence makes it return nothing
    returned: set[str] | None = field(default_factory=set)  # keys of returned dicts (None: unknown)
    reads: list[str] = field(default_factory=list)  # take_over: state keys read
    writes: set[str] = field(default_factory=set)  # take_over: state keys seen written (besides output_params)
    random: bool = False
    # not take_over: each returned key -> the arguments of `process` its value may depend on (None: unknown)
    output_deps: dict[str, frozenset[str]] | None = None
    # attributes of the pipeline `process` (and the unit's methods it calls) reads: `pipe.dit.patch_size` -> "dit"
    pipe_attributes: set[str] = field(default_factory=set)


@dataclass
class UnitDecl:
    """One unit as DiffSynth sees it: the raw declared values and the facts of its code."""

    class_name: str
    fields: dict[str, Any]
    process: ProcessFacts | None = None
    unreadable: list[str] = field(default_factory=list)


# --- reading process code ------------------------------------------------------------------------


def analyse_process(func: ast.FunctionDef, methods: dict[str, ast.FunctionDef], take_over: bool) -> ProcessFacts:
    """Guards, returned keys, state accesses and randomness of a `process` function."""
    facts = ProcessFacts()
    args = [a.arg for a in func.args.args]
    state_names = set(args[2:5]) if take_over else set()
    aliases: dict[str, str] = {}  # local variable -> state key, for take-over units
    for stmt in func.body:
        if take_over and isinstance(stmt, ast.Assign):
            _record_aliases(stmt, state_names, aliases)
        if isinstance(stmt, ast.If) and not stmt.orelse and _is_noop_body(stmt.body, args, take_over):
            for local in _none_tested(stmt.test, state_names):
                key = aliases.get(local, local)
                if key not in facts.guards:
                    facts.guards.append(key)
    if take_over:
        facts.reads, facts.writes = _state_accesses(func, state_names)
        facts.returned = set()
    else:
        facts.returned = _returned_keys(func)
    facts.random = bool(_calls(func, methods) & RANDOM_CALLS)
    facts.pipe_attributes = _pipe_attributes(func, methods)
    if not take_over and len(args) > 1:  # analysed as the unit runs in training (DiffSynth sets the flag)
        facts.output_deps = output_dependencies(func, {f"{args[1]}.scheduler.training": True})
    return facts


def output_dependencies(func: ast.FunctionDef, assume: dict[str, bool] | None = None) -> dict[str, frozenset[str]] | None:
    """Each key `process` returns -> the arguments (after `self, pipe`) its value may depend on; None when a return is
    not a dict of string keys. `assume`: conditions known while the unit runs (`{"pipe.scheduler.training": True}`:
    DiffSynth's training sets it), whose untaken side is not followed.

    A may-depend dataflow analysis over the function's statements, conservative where the code is not plain: an
    assigned name depends on every name its value mentions (through any call, attribute or subscript); a call may
    mutate its receiver and arguments with all it is given; a branch taints what it assigns and returns with its
    condition, and a branch that returns or raises taints what follows with its condition (the rest runs only when it
    was not taken). The two sides of a branch are followed apart and joined after it; loops are iterated until
    nothing changes. So a key whose set lacks an argument cannot see that argument: not its value, not whether it is
    None.

    >>> import textwrap
    >>> src = textwrap.dedent('''
    ...     def process(self, pipe, image, noise):
    ...         if image is None:
    ...             return {"latents": noise, "input_latents": None}
    ...         encoded = pipe.vae.encode(image)
    ...         if pipe.training:
    ...             return {"latents": noise, "input_latents": encoded}
    ...         return {"latents": pipe.add_noise(encoded, noise), "input_latents": encoded}''')
    >>> deps = output_dependencies(ast.parse(src).body[0], {"pipe.training": True})
    >>> sorted(deps["input_latents"]), sorted(deps["latents"])
    (['image'], ['image', 'noise'])

    Without the assumption the inference side counts too, where `pipe.add_noise(encoded, noise)` may change
    `encoded` in place:

    >>> sorted(output_dependencies(ast.parse(src).body[0])["input_latents"])
    ['image', 'noise']
    """
    Env = dict[str, frozenset[str]]
    params = [a.arg for a in func.args.args[2:]] + [a.arg for a in func.args.kwonlyargs]
    assumed = dict(assume or {})

    def known_condition(test: ast.expr) -> bool | None:
        negated = isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not)
        value = assumed.get(ast.unparse(test.operand if negated else test))
        return None if value is None else (not value if negated else value)

    result: dict[str, set[str]] = {}
    unknown = False

    def deps(env: Env, node: ast.AST | None) -> frozenset[str]:
        found: set[str] = set()
        if node is not None:
            for sub in ast.walk(node):
                if isinstance(sub, ast.Name):
                    found |= env.get(sub.id, frozenset())
        return frozenset(found)

    def taint(env: Env, target: ast.AST, value: frozenset[str], replace: bool = False) -> None:
        """`value` into the names of `target`: a plain name assigned is replaced, a subscript or attribute store or a
        mutation adds to its base."""
        if replace and isinstance(target, ast.Name):
            env[target.id] = value
            return
        for sub in ast.walk(target):
            if isinstance(sub, ast.Name):
                env[sub.id] = env.get(sub.id, frozenset()) | value

    def calls(env: Env, node: ast.AST, ctrl: frozenset[str]) -> None:
        for sub in ast.walk(node):
            if isinstance(sub, ast.Call):
                flowing = deps(env, sub) | ctrl
                for part in (sub.func, *sub.args, *(k.value for k in sub.keywords)):
                    taint(env, part, flowing)

    def join(a: Env | None, b: Env | None) -> Env | None:
        if a is None or b is None:
            return b if a is None else a
        return {k: a.get(k, frozenset()) | b.get(k, frozenset()) for k in set(a) | set(b)}

    def returned(env: Env, value: ast.expr | None, ctrl: frozenset[str]) -> None:
        nonlocal unknown
        if value is None or (isinstance(value, ast.Constant) and value.value is None):
            return
        if isinstance(value, ast.Dict) and all(isinstance(k, ast.Constant) and isinstance(k.value, str)
                                               for k in value.keys):
            pairs = [(k.value, v) for k, v in zip(value.keys, value.values)]
        elif (isinstance(value, ast.Call) and getattr(value.func, "id", None) == "dict" and not value.args
              and all(k.arg for k in value.keywords)):
            pairs = [(k.arg, k.value) for k in value.keywords]
        else:
            unknown = True
            return
        for key, v in pairs:
            result.setdefault(key, set()).update(deps(env, v) | ctrl)

    def block(body: list[ast.stmt], env: Env, ctrl: frozenset[str]) -> tuple[Env | None, frozenset[str]]:
        """(the environment after `body`, or None when every path through it returns or raises; the control
        dependencies of what follows)."""
        for stmt in body:
            known = known_condition(stmt.test) if isinstance(stmt, ast.If) else None
            if known is not None:  # one side only, as the unit runs in training
                after, ctrl = block(stmt.body if known else stmt.orelse, env, ctrl)
                if after is None:
                    return None, ctrl
                env = after
            elif isinstance(stmt, ast.If):
                calls(env, stmt.test, ctrl)
                inner = ctrl | deps(env, stmt.test)
                then, _ = block(stmt.body, dict(env), inner)
                other, _ = block(stmt.orelse, dict(env), inner)
                if then is None or other is None:
                    ctrl = inner  # what follows runs only on the side that did not return
                joined = join(then, other)
                if joined is None:
                    return None, ctrl
                env = joined
            elif isinstance(stmt, (ast.For, ast.AsyncFor, ast.While)):
                head = stmt.test if isinstance(stmt, ast.While) else stmt.iter
                calls(env, head, ctrl)
                inner = ctrl | deps(env, head)
                state = dict(env)
                for _ in range(100):  # until the loop head's environment stops growing
                    entry = dict(state)
                    if not isinstance(stmt, ast.While):
                        taint(entry, stmt.target, inner)
                    after, _ = block(stmt.body, entry, inner)
                    grown = join(state, after) or state
                    if grown == state:
                        break
                    state = grown
                after, _ = block(stmt.orelse, dict(state), inner)
                env = join(state, after) or state
                if any(isinstance(n, (ast.Return, ast.Raise, ast.Break)) for n in _walk_own(stmt)):
                    ctrl = inner
            elif isinstance(stmt, (ast.With, ast.AsyncWith)):
                for item in stmt.items:
                    calls(env, item.context_expr, ctrl)
                    if item.optional_vars is not None:
                        taint(env, item.optional_vars, deps(env, item.context_expr) | ctrl)
                after, ctrl = block(stmt.body, env, ctrl)
                if after is None:
                    return None, ctrl
                env = after
            elif isinstance(stmt, ast.Try):
                paths = [block(stmt.body, dict(env), ctrl)[0]]
                for handler in stmt.handlers:
                    paths.append(block(handler.body, dict(env), ctrl)[0])
                merged: Env | None = None
                for path in paths:
                    merged = join(merged, path)
                env = join(merged, env) or env  # an exception may leave at any point of the body
                after, _ = block(stmt.orelse + stmt.finalbody, env, ctrl)
                if after is None:
                    return None, ctrl
                env = after
            elif isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                taint(env, ast.Name(stmt.name), deps(env, stmt) | ctrl)
            elif isinstance(stmt, ast.Return):
                calls(env, stmt, ctrl)
                returned(env, stmt.value, ctrl)
                return None, ctrl
            elif isinstance(stmt, ast.Raise):
                return None, ctrl
            else:
                calls(env, stmt, ctrl)
                if isinstance(stmt, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
                    value = deps(env, stmt.value) | ctrl
                    targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
                    if isinstance(stmt, ast.AugAssign):
                        value |= deps(env, stmt.target)
                    for target in targets:
                        taint(env, target, value, replace=isinstance(stmt, (ast.Assign, ast.AnnAssign)))
        return env, ctrl

    block(func.body, {p: frozenset({p}) for p in params}, frozenset())
    if unknown:
        return None
    return {key: frozenset(d & set(params)) for key, d in result.items()}


def _walk_own(node: ast.AST):
    """ast.walk that does not enter nested functions, lambdas or classes."""
    stack = list(ast.iter_child_nodes(node))
    while stack:
        child = stack.pop()
        yield child
        if not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
            stack.extend(ast.iter_child_nodes(child))


def _is_noop_body(body: list[ast.stmt], args: list[str], take_over: bool) -> bool:
    if len(body) != 1 or not isinstance(body[0], ast.Return):
        return False
    value = body[0].value
    if value is None or (isinstance(value, ast.Constant) and value.value is None):
        return True
    if isinstance(value, ast.Dict) and not value.keys:
        return True
    if isinstance(value, ast.Call) and getattr(value.func, "id", None) == "dict" and not value.args and not value.keywords:
        return True
    if take_over and isinstance(value, ast.Tuple):
        return [getattr(e, "id", None) for e in value.elts] == args[2:5]
    return False


def _none_tested(test: ast.expr, state_names: set[str]) -> list[str]:
    """Names n such that `n is None` (or `not n`) alone makes `test` true."""
    if isinstance(test, ast.BoolOp) and isinstance(test.op, ast.Or):
        found: list[str] = []
        for value in test.values:
            found += [n for n in _none_tested(value, state_names) if n not in found]
        return found
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        name = _name_or_state_get(test.operand, state_names)
        return [name] if name else []
    if (isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], (ast.Is, ast.Eq))
            and isinstance(test.comparators[0], ast.Constant) and test.comparators[0].value is None):
        name = _name_or_state_get(test.left, state_names)
        return [name] if name else []
    return []


def _name_or_state_get(node: ast.expr, state_names: set[str]) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    return _state_key(node, state_names)


def _state_key(node: ast.expr, state_names: set[str]) -> str | None:
    """"x" for `inputs_shared.get("x", ...)` or `inputs_shared["x"]`."""
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get"
            and isinstance(node.func.value, ast.Name) and node.func.value.id in state_names
            and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
        return node.args[0].value
    if (isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name) and node.value.id in state_names
            and isinstance(node.slice, ast.Constant) and isinstance(node.slice.value, str)):
        return node.slice.value
    return None


def _record_aliases(stmt: ast.Assign, state_names: set[str], aliases: dict[str, str]) -> None:
    for target in stmt.targets:
        if isinstance(target, ast.Name):
            key = _state_key(stmt.value, state_names)
            if key:
                aliases[target.id] = key
        elif isinstance(target, ast.Tuple) and isinstance(stmt.value, ast.Tuple) and len(target.elts) == len(stmt.value.elts):
            for t, v in zip(target.elts, stmt.value.elts):
                key = _state_key(v, state_names)
                if isinstance(t, ast.Name) and key:
                    aliases[t.id] = key


def _state_accesses(func: ast.FunctionDef, state_names: set[str]) -> tuple[list[str], set[str]]:
    """Keys a take-over unit reads and writes in the state dicts; `update(variable)` hides its keys
    (output_params stands for them)."""
    reads: dict[str, None] = {}
    writes: set[str] = set()
    for node in _walk_own(func):
        if isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Store):
            key = _state_key(node, state_names)
            if key:
                writes.add(key)
            continue
        key = _state_key(node, state_names)
        if key:
            reads[key] = None
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "update"
                and isinstance(node.func.value, ast.Name) and node.func.value.id in state_names and node.args):
            arg = node.args[0]
            if isinstance(arg, ast.Dict):
                writes.update(k.value for k in arg.keys if isinstance(k, ast.Constant) and isinstance(k.value, str))
    return list(reads), writes


def _returned_keys(func: ast.FunctionDef) -> set[str] | None:
    keys: set[str] = set()
    for node in _walk_own(func):
        if not isinstance(node, ast.Return) or node.value is None:
            continue
        value = node.value
        if isinstance(value, ast.Constant) and value.value is None:
            continue
        if isinstance(value, ast.Call) and getattr(value.func, "id", None) == "dict" and not value.args:
            keys.update(k.arg for k in value.keywords if k.arg)
            if all(k.arg for k in value.keywords):
                continue
            return None
        if isinstance(value, ast.Dict) and all(isinstance(k, ast.Constant) and isinstance(k.value, str) for k in value.keys):
            keys.update(k.value for k in value.keys)
        else:
            return None
    return keys


def _reachable(func: ast.FunctionDef, methods: dict[str, ast.FunctionDef]) -> list[ast.FunctionDef]:
    """`func` and the unit's methods it reaches through `self.method(...)` calls, each once."""
    reached = [func]
    seen: set[str] = set()
    for current in reached:
        for node in ast.walk(current):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and isinstance(node.func.value, ast.Name) and node.func.value.id == "self"
                    and node.func.attr in methods and node.func.attr not in seen):
                seen.add(node.func.attr)
                reached.append(methods[node.func.attr])
    return reached


def _calls(func: ast.FunctionDef, methods: dict[str, ast.FunctionDef]) -> set[str]:
    """Names of the functions `func` calls, following `self.method(...)` calls within the unit class."""
    calls: set[str] = set()
    for current in _reachable(func, methods):
        for node in ast.walk(current):
            if isinstance(node, ast.Call):
                name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
                if name:
                    calls.add(name)
    return calls


def _pipe_attributes(func: ast.FunctionDef, methods: dict[str, ast.FunctionDef]) -> set[str]:
    """Attributes read from the pipeline argument (the one after `self`) of `func` and of the unit's methods it calls."""
    found: set[str] = set()
    for current in _reachable(func, methods):
        args = [a.arg for a in current.args.args]
        pipe = args[1] if len(args) > 1 else None
        found.update(node.attr for node in ast.walk(current)
                     if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == pipe)
    return found


def _class_methods(classes: list[ast.ClassDef]) -> dict[str, ast.FunctionDef]:
    """Methods by name, a subclass's own first."""
    methods: dict[str, ast.FunctionDef] = {}
    for cls in classes:
        for stmt in cls.body:
            if isinstance(stmt, ast.FunctionDef):
                methods.setdefault(stmt.name, stmt)
    return methods


def _init_call(init: ast.FunctionDef) -> ast.Call | None:
    """The `super().__init__(...)` (or `Base.__init__(self, ...)`) call of a unit's __init__."""
    for node in ast.walk(init):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "__init__":
            owner = node.func.value
            if isinstance(owner, ast.Call) and getattr(owner.func, "id", None) == "super":
                return node
            if isinstance(owner, (ast.Name, ast.Attribute)):
                return node
    return None


def _declared_fields(call: ast.Call) -> tuple[dict[str, Any], list[str]]:
    fields: dict[str, Any] = {}
    unreadable: list[str] = []
    args = list(call.args)
    owner = call.func.value  # `Base.__init__(self, ...)` passes self first
    if not isinstance(owner, ast.Call) and args and isinstance(args[0], ast.Name) and args[0].id == "self":
        args = args[1:]
    pairs = list(zip(FIELDS, args)) + [(k.arg, k.value) for k in call.keywords if k.arg]
    for key, node in pairs:
        if key not in FIELDS:
            continue
        try:
            fields[key] = ast.literal_eval(node)
        except (ValueError, SyntaxError, TypeError):
            unreadable.append(key)
    return fields, unreadable


# --- the static path: a source folder ------------------------------------------------------------


class _SourceReader:
    """Parsed modules of a DiffSynth source tree, with classes found through relative imports."""

    def __init__(self, pipelines_dir: Path, where: str):
        self.dir = pipelines_dir
        self.where = where
        self.modules: dict[Path, ast.Module] = {}

    def parse(self, path: Path) -> ast.Module:
        if path not in self.modules:
            try:
                self.modules[path] = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
            except (OSError, UnicodeDecodeError) as exc:
                raise SpecError(f"cannot read {path}: {exc}", source=self.where) from None
            except SyntaxError as exc:
                raise SpecError(f"{path.name} line {exc.lineno}: {exc.msg}", source=self.where) from None
        return self.modules[path]

    def find_class(self, path: Path, name: str, depth: int = 0) -> ast.ClassDef | None:
        tree = self.parse(path)
        for stmt in tree.body:
            if isinstance(stmt, ast.ClassDef) and stmt.name == name:
                stmt._unitgraph_path = path  # where its bases are looked up
                return stmt
        if depth > 4:
            return None
        for stmt in tree.body:
            if isinstance(stmt, ast.ImportFrom) and stmt.level >= 1:
                for alias in stmt.names:
                    if (alias.asname or alias.name) == name:
                        target = self._module_path(path, stmt.level, stmt.module)
                        if target is not None:
                            return self.find_class(target, alias.name, depth + 1)
        return None

    def _module_path(self, path: Path, level: int, module: str | None) -> Path | None:
        base = path.parent
        for _ in range(level - 1):
            base = base.parent
        parts = module.split(".") if module else []
        candidate = base.joinpath(*parts)
        for option in (candidate.with_suffix(".py"), candidate / "__init__.py"):
            if option.is_file():
                return option
        return None

    def lineage(self, cls: ast.ClassDef) -> list[ast.ClassDef]:
        """The class and its unit base classes found in the source (nearest first)."""
        out = [cls]
        while len(out) < 8:
            current = out[-1]
            parent = None
            for base in current.bases:
                base_name = base.id if isinstance(base, ast.Name) else getattr(base, "attr", None)
                if base_name and base_name not in ("PipelineUnit", "BasePipeline", "object"):
                    parent = self.find_class(current._unitgraph_path, base_name)
                    if parent is not None:
                        break
            if parent is None:
                break
            out.append(parent)
        return out


def _pipelines_dir(source: str | Path, module_name: str, where: str) -> Path:
    root = Path(source)
    if not root.is_dir():
        raise SpecError(f"--source {str(source)!r} is not a folder", source=where)
    for candidate in (root / "diffsynth" / "pipelines", root / "pipelines", root):
        if (candidate / f"{module_name}.py").is_file():
            return candidate
    raise SpecError(f"no {module_name}.py under {source} (looked in diffsynth/pipelines/, pipelines/ and the folder itself)",
                    source=where)


def from_source(source: str | Path, module_name: str, class_name: str | None = None, *, where: str | None = None,
                **options: Any) -> Pipeline:
    """Read `diffsynth/pipelines/MODULE.py` under `source` statically (nothing is imported)."""
    where = where or f"diffsynth:{module_name}.{class_name or ''}"
    pipelines_dir = _pipelines_dir(source, module_name, where)
    reader = _SourceReader(pipelines_dir, where)
    path = pipelines_dir / f"{module_name}.py"
    tree = reader.parse(path)
    pipeline_cls = _pipeline_class(tree, class_name, path, where)
    unit_calls, in_iteration = _pipeline_init(reader, pipeline_cls, where)
    decls = []
    for k, (unit_name, call) in enumerate(unit_calls):
        cls = reader.find_class(path, unit_name)
        if cls is None:
            raise SpecError(f"unit class {unit_name} (self.units[{k}]) is not defined in {path.name} or a module it "
                            f"imports from", source=where)
        decls.append(_decl_from_class(reader, cls, call))
    return build_pipeline(pipeline_cls.name, decls, in_iteration, where=where, **options)


def _pipeline_class(tree: ast.Module, class_name: str | None, path: Path, where: str) -> ast.ClassDef:
    classes = [s for s in tree.body if isinstance(s, ast.ClassDef)]
    if class_name is not None:
        for cls in classes:
            if cls.name == class_name:
                cls._unitgraph_path = path
                return cls
        raise SpecError(f"{path.name} defines no class {class_name}", source=where)
    candidates = [c for c in classes if _assigns_units(c)]
    if len(candidates) != 1:
        names = ", ".join(c.name for c in candidates) or "none"
        raise SpecError(f"name the pipeline class (MODULE.Class); classes that set self.units: {names}", source=where)
    candidates[0]._unitgraph_path = path
    return candidates[0]


def _assigns_units(cls: ast.ClassDef) -> bool:
    return any(isinstance(n, ast.Attribute) and n.attr == "units" and isinstance(n.ctx, ast.Store)
               for n in ast.walk(cls))


def _pipeline_init(reader: _SourceReader, cls: ast.ClassDef, where: str):
    """(unit class names with their constructor calls, in_iteration_models) from the pipeline's __init__."""
    units = None
    in_iteration: Any = None
    for current in reader.lineage(cls):
        init = next((s for s in current.body if isinstance(s, ast.FunctionDef) and s.name == "__init__"), None)
        if init is None:
            continue
        for node in ast.walk(init):
            if not isinstance(node, ast.Assign):
                continue
            for target in node.targets:
                if not (isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) and target.value.id == "self"):
                    continue
                if target.attr == "units" and units is None:
                    if not isinstance(node.value, (ast.List, ast.Tuple)):
                        raise SpecError(f"{cls.name}.__init__ builds self.units with code, not a list of units; "
                                        f"install DiffSynth-Studio and drop --source to read it from the objects",
                                        source=where)
                    units = []
                    for k, element in enumerate(node.value.elts):
                        if not (isinstance(element, ast.Call) and isinstance(element.func, ast.Name)):
                            raise SpecError(f"self.units[{k}] of {cls.name} is not a `UnitClass(...)` call", source=where)
                        units.append((element.func.id, element))
                elif target.attr == "in_iteration_models" and in_iteration is None:
                    try:
                        in_iteration = ast.literal_eval(node.value)
                    except (ValueError, SyntaxError, TypeError):
                        note(f"diffsynth: cannot read {cls.name}.in_iteration_models statically")
        if units is not None:
            break
    if units is None:
        raise SpecError(f"{cls.name} sets no self.units in __init__", source=where)
    return units, in_iteration


def _decl_from_class(reader: _SourceReader, cls: ast.ClassDef, call: ast.Call) -> UnitDecl:
    lineage = reader.lineage(cls)
    methods = _class_methods(lineage)
    fields: dict[str, Any] = {}
    unreadable: list[str] = []
    init = methods.get("__init__")
    init_call = _init_call(init) if init is not None else None
    if init_call is not None:
        fields, unreadable = _declared_fields(init_call)
        if call.args or call.keywords:
            # declarations computed from constructor arguments cannot be read without running them
            uses_args = {a.arg for a in init.args.args[1:]}
            names = {n.id for n in ast.walk(init_call) if isinstance(n, ast.Name)}
            if uses_args & names:
                unreadable.append("(constructor arguments)")
    process = methods.get("process")
    facts = analyse_process(process, methods, bool(fields.get("take_over"))) if process is not None else None
    return UnitDecl(cls.name, fields, facts, unreadable)


# --- the installed package ------------------------------------------------------------------------


def from_installed(module_name: str, class_name: str | None = None, *, where: str | None = None,
                   trust_remote_code: bool = False, **options: Any) -> Pipeline:
    """Read the units from the installed `diffsynth` package: the pipeline is created on the CPU.

    A `diffsynth` that is not installed code (see `untrusted_location`) is imported only with
    `trust_remote_code=True`.
    """
    where = where or f"diffsynth:{module_name}.{class_name or ''}"
    place = untrusted_location("diffsynth")
    if place is not None and not trust_remote_code:
        raise refuse_untrusted(f"importing diffsynth would run code from {place}, which is not an installed "
                               f"package (--source {place} reads it without running it)", where)
    try:
        module = importlib.import_module(f"diffsynth.pipelines.{module_name}")
    except ImportError as exc:
        raise SpecError(f"cannot import diffsynth.pipelines.{module_name}: {exc}", source=where) from None
    cls = _installed_pipeline_class(module, class_name, where)
    try:
        pipe = cls(device="cpu")
    except Exception as exc:  # fall back on reading the installed source
        folder = Path(inspect.getsourcefile(module)).parent
        note(f"diffsynth: {cls.__name__}(device='cpu') failed ({type(exc).__name__}: {exc}); read {folder} statically")
        return from_source(folder, module_name, cls.__name__, where=where, **options)
    return from_object(pipe, where=where, **options)


def declarations(pipe: Any) -> list[UnitDecl]:
    """The declarations and code facts of a DiffSynth pipeline object's units, in order."""
    return [_decl_from_object(unit) for unit in list(getattr(pipe, "units", []) or [])]


def from_object(pipe: Any, *, where: str | None = None, **options: Any) -> Pipeline:
    """The pipeline of a DiffSynth pipeline object as it is now: a unit per entry of `pipe.units`, in order (the
    diffusion backend plans the very units it then runs, backends/diffusion/diffsynth_source)."""
    decls = declarations(pipe)
    name = type(pipe).__name__
    return build_pipeline(name, decls, getattr(pipe, "in_iteration_models", None), where=where or f"diffsynth:{name}",
                          **options)


def _installed_pipeline_class(module, class_name: str | None, where: str) -> type:
    if class_name is not None:
        cls = getattr(module, class_name, None)
        if not inspect.isclass(cls):
            raise SpecError(f"{module.__name__} has no class {class_name}", source=where)
        return cls
    own = [c for c in vars(module).values() if inspect.isclass(c) and c.__module__ == module.__name__
           and any(b.__name__ == "BasePipeline" for b in c.__mro__[1:])]
    if len(own) != 1:
        names = ", ".join(c.__name__ for c in own) or "none"
        raise SpecError(f"name the pipeline class (MODULE.Class); pipeline classes: {names}", source=where)
    return own[0]


def _decl_from_object(unit: Any) -> UnitDecl:
    fields = {key: getattr(unit, key, None) for key in FIELDS}
    facts = None
    classes = []
    for klass in type(unit).__mro__:
        if klass.__name__ in ("PipelineUnit", "object"):
            break
        try:
            source = textwrap.dedent(inspect.getsource(klass))
            classes.append(next(s for s in ast.parse(source).body if isinstance(s, ast.ClassDef)))
        except (OSError, TypeError, SyntaxError, StopIteration):
            continue
    methods = _class_methods(classes)
    if "process" in methods:
        facts = analyse_process(methods["process"], methods, bool(fields.get("take_over")))
    return UnitDecl(type(unit).__name__, fields, facts)


# --- declarations to a Pipeline -------------------------------------------------------------------


def build_pipeline(
    name: str,
    decls: list[UnitDecl],
    in_iteration_models: Any,
    *,
    where: str = "<diffsynth>",
    deterministic: Iterable[str] = (),
    nondeterministic: Iterable[str] = (),
) -> Pipeline:
    """Map unit declarations to a Pipeline, warning about mistakes that change DiffSynth's behaviour.

    `deterministic` / `nondeterministic` override the rule for the units (short or class names) listed.
    """
    names = _unit_names([d.class_name for d in decls])
    force_det, force_random = set(deterministic), set(nondeterministic)
    sink_models = _as_names(in_iteration_models)
    known_models = set(sink_models)
    for decl in decls:
        known_models.update(_as_names(decl.fields.get("onload_model_names")))
    units = []
    unreadable = []
    for decl, unit_name in zip(decls, names):
        _check_declaration(decl, known_models)
        _check_model_reads(decl, known_models)
        if decl.unreadable:
            unreadable.append(f"{decl.class_name} ({', '.join(decl.unreadable)})")
        units.append(_unit(decl, unit_name, force_det, force_random, frozenset(known_models)))
    if isinstance(in_iteration_models, str):
        _warn_string("pipeline", "in_iteration_models", in_iteration_models, known_models)
    if unreadable:
        note(f"diffsynth: declarations that are not literals, left out: {short_list(unreadable, 4)}")
    sink = None
    if sink_models:
        params = list(dict.fromkeys(p for u in units for p in (*u.inputs, *u.outputs)))
        sink = Sink(inputs=tuple(params), models=tuple(sink_models))
    else:
        note(f"diffsynth: {name} declares no in_iteration_models; the sink reads every param and calls the "
             f"models that need backward")
    return Pipeline(name, tuple(units), sink, source=where)


def _unit_names(class_names: list[str]) -> list[str]:
    """Class names without their shared `XxxUnit_` prefix (kept when stripping would clash); unique."""
    prefixes = {m.group(1) for m in (re.match(r"^(\w*?Unit_)\w", n) for n in class_names) if m}
    names = list(class_names)
    if len(prefixes) == 1:
        prefix = prefixes.pop()
        stripped = [n[len(prefix):] if n.startswith(prefix) else n for n in class_names]
        if len(set(stripped)) == len(set(class_names)):
            names = stripped
    seen: dict[str, int] = {}
    out = []
    for n in names:
        seen[n] = seen.get(n, 0) + 1
        out.append(n if seen[n] == 1 else f"{n}#{seen[n]}")
    return out


def _as_names(value: Any) -> list[str]:
    """What a declaration means: a bare string stands for the one-element tuple it was meant to be."""
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [v for v in value.values() if isinstance(v, str)]
    try:
        return [v for v in value if isinstance(v, str)]
    except TypeError:
        return []


def _unit(decl: UnitDecl, unit_name: str, force_det: set[str], force_random: set[str],
          known_models: frozenset[str] = frozenset()) -> Unit:
    f = decl.fields
    facts = decl.process or ProcessFacts(returned=None)
    posi = f.get("input_params_posi") if isinstance(f.get("input_params_posi"), dict) else {}
    inputs = list(dict.fromkeys([*_as_names(f.get("input_params")), *_as_names(f.get("input_params_posi")),
                                 *_as_names(f.get("input_params_nega"))]))
    declared_out = _as_names(f.get("output_params"))
    outputs = list(dict.fromkeys(declared_out))
    if f.get("take_over"):
        inputs += [p for p in facts.reads if p not in inputs]
        if facts.writes:
            outputs += sorted(p for p in facts.writes if p not in outputs)
        requires = [p for p in facts.guards if p in inputs]
    else:
        if facts.returned:
            outputs += sorted(p for p in facts.returned if p not in outputs)
        # process receives input_params under their names and the posi side under its local names
        local = {**{k: v for k, v in posi.items() if isinstance(v, str)}, **{p: p for p in _as_names(f.get("input_params"))}}
        requires = list(dict.fromkeys(local[g] for g in facts.guards if g in local))
    models = _as_names(f.get("onload_model_names"))
    configs = tuple(sorted(m for m in facts.pipe_attributes & known_models if m not in models))
    random = facts.random
    if unit_name in force_random or decl.class_name in force_random:
        random = True
    elif unit_name in force_det or decl.class_name in force_det:
        random = False
    return Unit(unit_name, tuple(inputs), tuple(outputs), tuple(dict.fromkeys(models)), deterministic=not random,
                requires=tuple(requires), configs=configs)


def _check_model_reads(decl: UnitDecl, known_models: set[str]) -> None:
    """A warning for a model of the pipeline the unit's code reads but its onload_model_names does not name.

    The unit keeps the model as a config read (`Unit.configs`): DiffSynth's own split would run it without that model
    loaded, and unitgraph's stage 1 gives it the model's skeleton (backends/diffusion/diffsynth_source)."""
    facts = decl.process
    if facts is None:
        return
    declared = set(_as_names(decl.fields.get("onload_model_names")))
    for model in sorted((facts.pipe_attributes & known_models) - declared):
        declaration_warning(f"diffsynth: {decl.class_name} reads the model {model} (pipe.{model}) but its "
                            "onload_model_names does not name it; planned as reading its config only")


def _check_declaration(decl: UnitDecl, known_models: set[str]) -> None:
    f = decl.fields
    for key in TUPLE_FIELDS:
        value = f.get(key)
        if isinstance(value, str):
            _warn_string(decl.class_name, key, value, known_models)
        elif value is not None and not isinstance(value, (tuple, list)):
            declaration_warning(f"diffsynth: {decl.class_name}: {key} is a {type(value).__name__}, expected a tuple of names")
    for key in DICT_FIELDS:
        value = f.get(key)
        if value is not None and not isinstance(value, dict):
            declaration_warning(f"diffsynth: {decl.class_name}: {key} is a {type(value).__name__}, expected a dict "
                                f"{{argument name: param name}}; DiffSynth calls .items() on it")
    facts = decl.process
    if facts is not None and not f.get("take_over") and facts.returned:
        missing = sorted(facts.returned - set(_as_names(f.get("output_params"))))
        if missing:
            declaration_warning(f"diffsynth: {decl.class_name}: process returns {', '.join(missing)} but output_params "
                                f"does not declare {'it' if len(missing) == 1 else 'them'}; DiffSynth's split cannot see "
                                f"{'that write' if len(missing) == 1 else 'those writes'} (taken as outputs here)")


def _warn_string(owner: str, key: str, value: str, known_models: set[str]) -> None:
    chars = ", ".join(repr(c) for c in list(dict.fromkeys(value))[:4])
    head = (f"diffsynth: {owner}: {key}=({value!r}) is the string {value!r}, not a one-element tuple; write "
            f"({value!r},).")
    if key in ("onload_model_names", "in_iteration_models"):
        others = sorted(m for m in known_models if m != value and m in value)
        if others:
            tail = (f" DiffSynth tests model names against it as a substring, so it also treats {', '.join(others)} "
                    f"as {'called by this unit' if key == 'onload_model_names' else 'used in the denoising loop'}")
        else:
            tail = (" DiffSynth tests model names against it as a substring (`name in " + repr(value) + "`), which "
                    "matches only by luck today")
    elif key == "input_params":
        tail = f" DiffSynth iterates its characters ({chars}, ...): its split and its unit runner see those as params"
    else:
        tail = (f" DiffSynth iterates its characters ({chars}, ...): its split sees those as outputs and misses the "
                f"write of {value}")
    declaration_warning(head + tail)


PIPELINES: dict = {}  # open-ended names: `resolve` answers every reference

__all__ = ["ProcessFacts", "UnitDecl", "analyse_process", "build_pipeline", "declarations", "from_installed",
           "from_object", "from_source", "output_dependencies", "resolve"]
