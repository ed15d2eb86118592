"""The readers of training states, LoRA files and encoded validation prompts (docs/safety.md, 'Training states,
LoRA files and encoded prompts'): whatever the file, a correct result or one BackendError line naming it, and a
refused file changes nothing (not the weights, not the optimizer, not loss.csv).

The properties run on generated files: states whose state.json, tensors or bytes were tampered with (with and
without the digest in state.json updated, as a careful tamperer would), LoRA files built from keys, shapes, dtypes
and metadata of every kind, and damaged validation.safetensors files. The examples name each case once.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any, Callable

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("peft")
pytest.importorskip("diffusers")

from hypothesis import HealthCheck, currently_in_test_context, event, example, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

from clitools import cli, one_error_line  # noqa: E402
from unitgraph.backends.diffusion.cache.cache import Cache  # noqa: E402
from unitgraph.backends.diffusion.cache.keys import sha256_file  # noqa: E402
from unitgraph.backends.diffusion.cache.verify import verify_cache  # noqa: E402
from unitgraph.backends.diffusion.errors import BackendError  # noqa: E402
from unitgraph.backends.diffusion.models.lora import (  # noqa: E402
    add_lora,
    load_lora_checkpoint,
    lora_state_dict,
    merge_preset_lora,
    read_lora_file,
)
from unitgraph.backends.diffusion.train.checkpoints import convert  # noqa: E402
from unitgraph.backends.diffusion.train.loop import LossLog, read_loss_csv  # noqa: E402
from unitgraph.backends.diffusion.train.resume import (  # noqa: E402
    STATE_FILES,
    load_state,
    save_state,
    states,
    trained_parameters,
)
from unitgraph.backends.diffusion.train.validation import VALIDATION_FILE, load_encoded, store_encoded  # noqa: E402

# UNITGRAPH_FUZZ_EXAMPLES=5000 hunts longer; the default keeps the file well under a minute
FUZZ = settings(max_examples=int(os.environ.get("UNITGRAPH_FUZZ_EXAMPLES", "40")), deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
SIZE = 32
PREFIXES = {"dit": "transformer", "text_encoder": "text_encoder", "vae": "vae"}
MATCH = {"seed": 3, "learning_rate": 1e-3}


def outcome(call: Callable[[], Any], source: str | Path) -> Any:
    """call(), or the BackendError it raised, checked to be one line naming a file at or under `source`."""
    try:
        return call()
    except BackendError as exc:
        line = exc.one_line()
        assert line and "\n" not in line and "Traceback" not in line, line
        assert exc.source is not None and str(exc.source).startswith(str(source)), line
        return exc


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-5, 10**6) | st.integers() | st.just(10**400) | st.floats()
    | st.text(max_size=6),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=8,
)


# ------------------------------------------------------------------------------------------------
# a tiny DiT with a LoRA adapter, and a fully trained bf16 model beside it


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.to_q = torch.nn.Linear(8, 8)
        self.to_k = torch.nn.Linear(8, 8)


class TinyDit(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.transformer_blocks = torch.nn.ModuleList([Block(), Block()])
        self.proj_out = torch.nn.Linear(8, 4)


LORA_MODULES = [f"transformer_blocks.{b}.{m}" for b in (0, 1) for m in ("to_q", "to_k")]


def lora_dit(seed: int = 0) -> TinyDit:
    torch.manual_seed(seed)
    model = TinyDit()
    add_lora(model, "dit", ["to_q", "to_k"], 2, 4.0, seed)
    return model


def training(seed: int) -> tuple[dict[str, Any], torch.optim.Optimizer]:
    """The trained parameters of a run (a LoRA on the DiT, a bf16 model trained fully) and its AdamW."""
    torch.manual_seed(seed)
    encoder = torch.nn.Linear(4, 4).to(torch.bfloat16)
    params = trained_parameters({"dit": lora_dit(seed), "te": encoder}, ["dit", "te"])
    return params, torch.optim.AdamW(list(params.values()), lr=1e-3, weight_decay=0.01)


def make_state(root: Path) -> Path:
    params, optimizer = training(0)
    generator = torch.Generator().manual_seed(1)
    for _ in range(2):
        for p in params.values():
            p.grad = torch.randn(p.shape, generator=generator).to(p.dtype)
        optimizer.step()
    rows = [(1, 0, 0.5, 0.25, 731.5), (2, 0, 0.375, 0.5, 12.0)]
    return save_state(root, 2, 0, 2, 0.5, rows, params, optimizer, MATCH)


def reseal(state: Path, name: str) -> None:
    """Record the file's new digest in state.json, as a tamperer who knows the format would."""
    record = json.loads((state / "state.json").read_text())
    record["files"][name] = sha256_file(state / name)
    (state / "state.json").write_text(json.dumps(record))


def attempt(state: Path, tmp: Path) -> Any:
    """load_state into a fresh run: the ResumePoint, or the BackendError, with what each implies checked."""
    params, optimizer = training(7)
    before = {k: v.detach().clone() for k, v in params.items()}
    result = outcome(lambda: load_state(state, params, optimizer, MATCH), state)
    if currently_in_test_context():  # what the property runs saw (--hypothesis-show-statistics)
        event("refused" if isinstance(result, BackendError) else "restored")
    if isinstance(result, BackendError):
        assert all(torch.equal(before[k], params[k].detach()) for k in params), "a refused state changed the weights"
        assert not optimizer.state, "a refused state changed the optimizer"
        return result
    saved = load_file(str(state / "trained.safetensors"))
    assert all(torch.equal(params[k].detach(), saved[k]) for k in params)
    for p in params.values():  # the restored optimizer steps, and the rows make a loss log
        p.grad = torch.ones_like(p)
    optimizer.step()
    assert all(torch.isfinite(p.detach().float()).all() for p in params.values())
    LossLog(tmp / "loss.csv", True, rows=result.rows).close()
    assert len(read_loss_csv(tmp / "loss.csv")) == result.step
    return result


# ------------------------------------------------------------------------------------------------
# training states: properties


def _paths(value: Any, prefix: tuple = ()) -> list[tuple]:
    out = [prefix]
    if isinstance(value, dict):
        for k, v in value.items():
            out += _paths(v, prefix + (k,))
    elif isinstance(value, list):
        for i, v in enumerate(value[:6]):
            out += _paths(v, prefix + (i,))
    return out


@FUZZ
@given(data=st.data())
@example(data=None)
def test_a_tampered_state_json_is_restored_or_one_line(tmp_path_factory, data):
    root = tmp_path_factory.mktemp("state")
    state = make_state(root)
    record = json.loads((state / "state.json").read_text())
    if data is None:  # the case that once cut loss.csv: a row that LossLog cannot write
        record["loss_rows"][1][2] = "0.3"
    else:
        for _ in range(data.draw(st.integers(1, 3))):
            path = data.draw(st.sampled_from(_paths(record)[1:]))
            parent = record
            for part in path[:-1]:
                parent = parent[part]
            if data.draw(st.booleans()):
                parent[path[-1]] = data.draw(json_values)
            elif isinstance(parent, dict):
                del parent[path[-1]]
            else:
                parent.pop(path[-1])
    (state / "state.json").write_text(json.dumps(record))
    result = attempt(state, root)
    if data is None:
        assert isinstance(result, BackendError) and "loss_rows[1]" in result.one_line()


TENSOR_EDITS = ["drop", "add", "reshape", "retype", "scalar", "nan", "negative", "big", "rename"]


def _edit(tensors: dict[str, torch.Tensor], data: Any) -> None:
    name = data.draw(st.sampled_from(sorted(tensors)))
    value = tensors[name]
    kind = data.draw(st.sampled_from(TENSOR_EDITS))
    if kind == "drop":
        del tensors[name]
    elif kind == "add":
        extra = data.draw(st.sampled_from(["0.momentum_buffer", "99.step", "dit/nowhere.weight", "01.exp_avg", "x"]))
        tensors[extra] = torch.zeros(2)
    elif kind == "reshape":
        shape = data.draw(st.lists(st.integers(0, 9), max_size=3))
        tensors[name] = torch.zeros(shape, dtype=value.dtype)
    elif kind == "retype":
        dtype = data.draw(st.sampled_from([torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.bool]))
        tensors[name] = value.to(dtype)
    elif kind == "scalar":
        tensors[name] = torch.tensor(float(data.draw(st.integers(-3, 5))))
    elif kind == "nan":
        tensors[name] = torch.full(value.shape, float(data.draw(st.sampled_from(["nan", "inf"])))).to(value.dtype)
    elif kind == "negative":
        tensors[name] = (-value.double().abs() - 1).to(value.dtype)
    elif kind == "big":
        tensors[name] = (value.double() + 1000).to(value.dtype)
    else:
        tensors[name.replace(".", "_", 1) if "." in name else name + "_"] = tensors.pop(name)


@FUZZ
@given(data=st.data(), name=st.sampled_from(STATE_FILES), how=st.sampled_from(["bytes", "tensors"]),
       resealed=st.booleans())
def test_a_tampered_or_damaged_tensor_file_is_restored_or_one_line(tmp_path_factory, data, name, how, resealed):
    root = tmp_path_factory.mktemp("state")
    state = make_state(root)
    path = state / name
    original = path.read_bytes()
    if how == "bytes":
        raw = bytearray(original)
        header_end = 8 + int.from_bytes(raw[:8], "little")
        limit = header_end - 1 if data.draw(st.booleans()) else len(raw) - 1  # the header half the time
        for at, value in data.draw(st.lists(st.tuples(st.integers(0, limit), st.integers(0, 255)), max_size=4)):
            raw[at] = value
        raw = bytes(raw[:data.draw(st.integers(0, len(raw)))]) + data.draw(st.binary(max_size=6))
        path.write_bytes(raw)
    else:
        tensors = load_file(str(path))
        for _ in range(data.draw(st.integers(1, 3))):
            if tensors:
                _edit(tensors, data)
        save_file(tensors, str(path))
    if resealed:
        reseal(state, name)
    result = attempt(state, root)
    if path.read_bytes() != original and not resealed:
        assert isinstance(result, BackendError) and "does not match the sha256" in result.one_line()


# ------------------------------------------------------------------------------------------------
# training states: each case once


def _tamper_json(**changes: Any) -> Callable[[Path], None]:
    def apply(state: Path) -> None:
        record = json.loads((state / "state.json").read_text())
        for key, value in changes.items():
            if value is KeyError:
                del record[key]
            elif callable(value):
                value(record)
            else:
                record[key] = value
        (state / "state.json").write_text(json.dumps(record))
    return apply


def _tamper_tensors(name: str, change: Callable[[dict], None], sealed: bool = True) -> Callable[[Path], None]:
    def apply(state: Path) -> None:
        tensors = load_file(str(state / name))
        change(tensors)
        save_file(tensors, str(state / name))
        if sealed:
            reseal(state, name)
    return apply


def _truncate(name: str, sealed: bool) -> Callable[[Path], None]:
    def apply(state: Path) -> None:
        raw = (state / name).read_bytes()
        (state / name).write_bytes(raw[:-7])
        if sealed:
            reseal(state, name)
    return apply


LORA_A = "dit/transformer_blocks.0.to_q.lora_A.default.weight"
STATE_CASES = {
    "step-a-string": (_tamper_json(step="2"), "state.json", "field 'step' is \"2\", not a step count"),
    "no-loss-rows": (_tamper_json(loss_rows=KeyError), "state.json", "no field 'loss_rows'"),
    "a-loss-that-is-text": (_tamper_json(loss_rows=[[1, 0, "x", 0.1, None], [2, 0, 0.3, 0.2, None]]), "state.json", "loss_rows[0]"),
    "a-row-missing": (_tamper_json(loss_rows=[[1, 0, 0.5, 0.1, None]]), "state.json", "1 loss rows for 2 steps"),
    "a-timestep-past-1000": (_tamper_json(loss_rows=[[1, 0, 0.5, 0.1, 5000.0], [2, 0, 0.3, 0.2, None]]), "state.json",
                             "loss_rows[0]"),
    "epoch-negative": (_tamper_json(epoch=-1), "state.json", "field 'epoch'"),
    "elapsed-null": (_tamper_json(elapsed_s=None), "state.json", "field 'elapsed_s'"),
    "a-loss-of-400-digits": (_tamper_json(loss_rows=[[1, 0, 10**400, 0.1, None], [2, 0, 0.3, 0.2, None]]), "state.json", "loss_rows[0]"),
    "groups-a-string": (_tamper_json(param_groups="x"), "state.json", "field 'param_groups'"),
    "another-eps": (_tamper_json(param_groups=lambda r: r["param_groups"][0].update(eps=0.5)), "state.json",
                    "param_groups[0] has eps 0.5"),
    "other-params": (_tamper_json(param_groups=lambda r: r["param_groups"][0].update(params=[0, 1])), "state.json",
                     "other parameters"),
    "files-a-list": (_tamper_json(files=["trained.safetensors"]), "state.json", "field 'files'"),
    "a-digest-not-hex": (_tamper_json(files=lambda r: r["files"].update({"trained.safetensors": "abc"})), "state.json",
                         "sha256 of"),
    "match-a-list": (_tamper_json(match=[1]), "state.json", "field 'match'"),
    "another-format": (_tamper_json(format="other/v1"), "state.json", "not a unitgraph training state"),
    "a-flipped-bit": (_tamper_tensors("trained.safetensors", lambda t: t[LORA_A].__setitem__((0, 0), 9.0), False),
                      "trained.safetensors", "does not match the sha256"),
    "a-weight-of-another-shape": (_tamper_tensors("trained.safetensors", lambda t: t.update({LORA_A: torch.zeros(3, 8)})),
                                  "trained.safetensors", "is [3, 8] float32, the trained parameter [2, 8] float32"),
    "a-weight-in-fp16": (_tamper_tensors("trained.safetensors", lambda t: t.update({LORA_A: t[LORA_A].half()})),
                         "trained.safetensors", "float16, the trained parameter [2, 8] float32"),
    "a-bf16-weight-in-fp32": (_tamper_tensors("trained.safetensors", lambda t: t.update({"te/weight": t["te/weight"].float()})),
                              "trained.safetensors", "te/weight is [4, 4] float32, the trained parameter [4, 4] bfloat16"),
    "a-weight-missing": (_tamper_tensors("trained.safetensors", lambda t: t.pop(LORA_A)), "trained.safetensors",
                         "trained parameters differ from this run's"),
    "a-nan-weight": (_tamper_tensors("trained.safetensors", lambda t: t[LORA_A].fill_(float("nan"))),
                     "trained.safetensors", "NaN or infinite"),
    "a-moment-in-fp16": (_tamper_tensors("optimizer.safetensors", lambda t: t.update({"0.exp_avg": t["0.exp_avg"].half()})),
                         "optimizer.safetensors", "tensor 0.exp_avg is [2, 8] float16, its parameter [2, 8] float32"),
    "a-moment-of-another-shape": (_tamper_tensors("optimizer.safetensors", lambda t: t.update({"1.exp_avg_sq": torch.zeros(8)})),
                                  "optimizer.safetensors", "1.exp_avg_sq is [8] float32"),
    "an-unknown-piece": (_tamper_tensors("optimizer.safetensors", lambda t: t.update({"0.momentum_buffer": torch.zeros(2, 8)})),
                         "optimizer.safetensors", "an unknown tensor 0.momentum_buffer"),
    "a-piece-missing": (_tamper_tensors("optimizer.safetensors", lambda t: t.pop("0.exp_avg_sq")), "optimizer.safetensors",
                        "no 0.exp_avg_sq"),
    "a-parameter-past-the-end": (_tamper_tensors("optimizer.safetensors", lambda t: t.update({"99.step": torch.tensor(1.0)})),
                                 "optimizer.safetensors", "for parameter 99, this run's optimizer has 10"),
    "a-step-of-one-element": (_tamper_tensors("optimizer.safetensors", lambda t: t.update({"0.step": torch.tensor([2.0])})),
                              "optimizer.safetensors", "0.step is [1] float32, not a single floating number"),
    "a-step-past-the-state": (_tamper_tensors("optimizer.safetensors", lambda t: t.update({"0.step": torch.tensor(1000.0)})),
                              "optimizer.safetensors", "0.step is not a step count of 0..2"),
    "a-negative-second-moment": (_tamper_tensors("optimizer.safetensors", lambda t: t["2.exp_avg_sq"].fill_(-1.0)),
                                 "optimizer.safetensors", "2.exp_avg_sq is not finite and >= 0"),
    "truncated-resealed": (_truncate("trained.safetensors", True), "trained.safetensors", "truncated"),
    "truncated": (_truncate("optimizer.safetensors", False), "optimizer.safetensors", "does not match the sha256"),
    "a-file-missing": (lambda s: (s / "optimizer.safetensors").unlink(), "optimizer.safetensors", "missing"),
    "not-json": (lambda s: (s / "state.json").write_text('{"format": '), "state.json", "malformed JSON"),
}


@pytest.mark.parametrize("case", list(STATE_CASES))
def test_each_damaged_state_is_one_line_naming_its_file(tmp_path, case):
    tamper, file, fragment = STATE_CASES[case]
    state = make_state(tmp_path)
    tamper(state)
    result = attempt(state, tmp_path)
    assert isinstance(result, BackendError), result
    line = result.one_line()
    assert Path(result.source).name == file and fragment in line, line


def test_an_untouched_state_restores_and_states_sort_by_step(tmp_path):
    state = make_state(tmp_path)
    point = attempt(state, tmp_path)
    assert (point.step, point.epoch, point.position, point.rows) == (2, 0, 2, [[1, 0, 0.5, 0.25, 731.5], [2, 0, 0.375, 0.5, 12.0]])
    later = state.parent / "step-100000000"  # past the 8 digits of the folder names: still the latest
    shutil.copytree(state, later)
    (state.parent / "step-x").mkdir()  # not a state
    assert states(tmp_path) == [state, later]


# ------------------------------------------------------------------------------------------------
# LoRA files: properties


HEADS = ["transformer.", "pipe.dit.", "", "diffusion_model.", "dit.", "text_encoder.", "pipe.text_encoder.", "unet.",
         "pipe.unet.", "base_model.model.", "lora_unet.", "text_encoder_2."]
FOREIGN = {"unet.", "pipe.unet.", "base_model.model.", "lora_unet.", "text_encoder_2."}
MODULES = {**{m: (8, 8) for m in LORA_MODULES}, "proj_out": (8, 4), "nowhere.to_q": (8, 8)}  # module -> (in, out)
DEFECTS = ["none"] * 6 + ["zero_d", "one_d", "three_d", "int", "bool", "half", "bf16", "rank", "no_B", "empty", "nan",
                          "alpha", "bad_alpha", "dora", "dora", "dora_len", "dora_2d", "dora_nan"]
HEADER_DEFECTS = {"zero_d", "one_d", "three_d", "int", "bool", "empty", "rank", "dora_2d"}
METADATA = [None, {"transformer.lora_alpha": 4.0, "transformer.r": 2}, {"lora_alpha": 1}, "[1, 2]", "{not json",
            {"lora_alpha": "eight"}, {"lora_alpha": 0}, {"transformer.lora_alpha": -1}, "{\"lora_alpha\": NaN}",
            {"lora_alpha": True}, {"r": 2.5}, {"transformer.r": 3}, {"text_encoder.lora_alpha": "x"},
            {"lora_alpha": 10**400}, {"r": 10**400},
            {"transformer.lora_alpha": 4.0, "transformer.r": 2, "transformer.use_rslora": True}]  # rsLoRA: alpha/sqrt(r)
BAD_METADATA = {3, 4, 5, 6, 7, 8, 9, 10, 12, 13, 14}  # indexes of METADATA that must be refused (11: unless ranks are 3)


def lora_tensors(entries: list[tuple[str, str, bool, int, str]], extra: bool) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    generator = torch.Generator().manual_seed(len(entries))
    for head, module, default, rank, defect in entries:
        fan_in, fan_out = MODULES[module]
        tag = ".default" if default else ""
        a = torch.randn(rank, fan_in, generator=generator)
        b = torch.randn(fan_out, rank + (defect == "rank"), generator=generator)
        if defect == "zero_d":
            a = torch.tensor(1.5)
        elif defect == "one_d":
            b = b.flatten()
        elif defect == "three_d":
            a = a[None]
        elif defect in ("int", "bool"):
            a = a.to(torch.int64 if defect == "int" else torch.bool)
        elif defect in ("half", "bf16"):
            a, b = a.to(torch.float16 if defect == "half" else torch.bfloat16), b.to(torch.bfloat16)
        elif defect == "empty":
            a = torch.zeros(0, fan_in)
        elif defect == "nan":
            b[0, 0] = float("nan")
        elif defect in ("alpha", "bad_alpha"):
            out[f"{head}{module}.alpha"] = torch.tensor(3.0 if defect == "alpha" else -2.0)
        elif defect.startswith("dora"):  # a DoRA magnitude per output row (peft's key), or a wrong one
            magnitude = torch.rand(fan_out + (defect == "dora_len"), generator=generator) + 0.5
            if defect == "dora_nan":
                magnitude[0] = float("nan")
            out[f"{head}{module}.lora_magnitude_vector{tag}"] = magnitude[None] if defect == "dora_2d" else magnitude
        out[f"{head}{module}.lora_A{tag}.weight"] = a
        if defect != "no_B":
            out[f"{head}{module}.lora_B{tag}.weight"] = b
    if extra:
        out["transformer.proj_out.weight"] = torch.zeros(4, 8)  # a fully trained model's weight beside the LoRA
    return out


_entry = st.tuples(st.sampled_from(HEADS), st.sampled_from(sorted(MODULES)), st.booleans(), st.sampled_from([2, 2, 2, 3]),
                   st.sampled_from(DEFECTS))
# half the files: a whole LoRA of the DiT (every module the adapter has) under one of its prefixes, plus a few others
_whole = st.tuples(st.sampled_from(["transformer.", "pipe.dit.", "", "diffusion_model."]), st.booleans(),
                   st.lists(st.sampled_from(["none"] * 12 + DEFECTS), min_size=4, max_size=4),
                   st.lists(_entry, max_size=2)).map(
    lambda t: [(t[0], m, t[0] == "pipe.dit." or t[1], 2, d) for m, d in zip(LORA_MODULES, t[2])] + t[3])
lora_entries = st.one_of(st.lists(_entry, max_size=4), _whole).map(
    lambda es: list({(h, m, tag): (h, m, tag, r, d) for h, m, tag, r, d in es}.values()))  # one entry per key


def deltas(lora: Any) -> dict[str, torch.Tensor]:
    """What each module of a read LoRA file adds to its weight: scale * B @ A."""
    return {m: lora.scales[m] * (lora.weights[f"{m}.lora_B.weight"].float() @ lora.weights[f"{m}.lora_A.weight"].float())
            for m in lora.modules if f"{m}.lora_A.weight" in lora.weights and f"{m}.lora_B.weight" in lora.weights}


@FUZZ
@given(entries=lora_entries, meta=st.sampled_from([0, 0, 1, 1, 2, *range(len(METADATA))]), extra=st.booleans(),
       to=st.sampled_from(["diffusers", "diffsynth"]))
@example(entries=[("transformer.", m, False, 2, "none") for m in LORA_MODULES], meta=1, extra=True, to="diffsynth")
@example(entries=[("transformer.", m, False, 2, "dora") for m in LORA_MODULES], meta=len(METADATA) - 1, extra=False,
         to="diffusers")  # a whole DoRA with rsLoRA's scale
@example(entries=[("pipe.dit.", m, True, 2, "alpha" if m.endswith("q") else "half") for m in LORA_MODULES], meta=0,
         extra=False, to="diffusers")
@example(entries=[("unet.", "transformer_blocks.0.to_q", False, 2, "none")], meta=0, extra=False, to="diffsynth")
@example(entries=[("transformer.", "transformer_blocks.0.to_q", False, 2, "zero_d")], meta=0, extra=False, to="diffusers")
@example(entries=[("transformer.", "transformer_blocks.0.to_q", False, 2, "int")], meta=1, extra=False, to="diffusers")
@example(entries=[("transformer.", "transformer_blocks.0.to_q", False, 2, "none")], meta=3, extra=False, to="diffusers")
@example(entries=[("transformer.", "transformer_blocks.0.to_q", False, 2, "none")], meta=5, extra=False, to="diffusers")
def test_a_lora_file_is_read_converted_and_loaded_as_it_means_or_one_line(tmp_path_factory, entries, meta, extra, to):
    folder = tmp_path_factory.mktemp("lora")
    path = folder / "in.safetensors"
    metadata = METADATA[meta]
    save_file(lora_tensors(entries, extra), str(path), metadata=None if metadata is None else {
        "lora_adapter_metadata": metadata if isinstance(metadata, str) else json.dumps(metadata)})
    must_refuse = (any(d in HEADER_DEFECTS for _, _, _, _, d in entries) or any(h in FOREIGN for h, *_ in entries)
                   or meta in BAD_METADATA or not entries)
    read = outcome(lambda: read_lora_file(path, "dit", PREFIXES), path)  # as `lora convert` reads it
    if must_refuse:
        assert isinstance(read, BackendError), (entries, metadata)
    converted = outcome(lambda: convert(path, folder / "out.safetensors", to, "dit", PREFIXES), path)
    if isinstance(read, BackendError):
        assert isinstance(converted, BackendError) and not (folder / "out.safetensors").exists()
    elif not isinstance(converted, BackendError):  # the converted file means what the source means, module by module
        back = read_lora_file(folder / "out.safetensors", "dit", PREFIXES)
        ours, theirs = deltas(read), deltas(back)
        assert set(ours) == set(theirs) and all(torch.allclose(ours[m], theirs[m], rtol=1e-2, atol=1e-3) for m in ours)
    # as --lora_checkpoint reads it: into the adapter of a model, which a refused file leaves as it was
    model = lora_dit()
    before = {k: v.clone() for k, v in lora_state_dict(model).items()}
    loaded = outcome(lambda: load_lora_checkpoint(model, "dit", path, PREFIXES), path)
    event(f"read {'refused' if isinstance(read, BackendError) else 'ok'}, converted "
          f"{'refused' if isinstance(converted, BackendError) else 'ok'}, loaded {'refused' if isinstance(loaded, BackendError) else 'ok'}")
    if must_refuse:
        assert isinstance(loaded, BackendError)
    if isinstance(loaded, BackendError):
        after = lora_state_dict(model)
        assert all(torch.equal(before[k], after[k]) for k in before)
    else:
        file = read_lora_file(path, "dit", PREFIXES, roots={"transformer_blocks", "proj_out"})
        for module, delta in deltas(file).items():
            layer = model.get_submodule(module)
            got = layer.scaling["default"] * (layer.lora_B["default"].weight @ layer.lora_A["default"].weight)
            assert torch.allclose(got, delta, rtol=1e-2, atol=1e-3), module


@FUZZ
@given(data=st.data())
def test_damaged_bytes_of_a_lora_file_are_read_or_one_line(tmp_path_factory, data):
    path = tmp_path_factory.mktemp("lora") / "in.safetensors"
    save_file(lora_tensors([("transformer.", m, False, 2, "none") for m in LORA_MODULES], False), str(path),
              metadata={"lora_adapter_metadata": json.dumps({"transformer.lora_alpha": 4.0, "transformer.r": 2})})
    raw = bytearray(path.read_bytes())
    header_end = 8 + int.from_bytes(raw[:8], "little")
    limit = header_end - 1 if data.draw(st.booleans()) else len(raw) - 1
    for at, value in data.draw(st.lists(st.tuples(st.integers(0, limit), st.integers(0, 255)), max_size=5)):
        raw[at] = value
    path.write_bytes(bytes(raw[:data.draw(st.integers(0, len(raw)))]) + data.draw(st.binary(max_size=8)))
    outcome(lambda: read_lora_file(path, "dit", PREFIXES), path)
    model = torch.nn.Sequential()
    model.add_module("transformer_blocks", TinyDit().transformer_blocks)
    outcome(lambda: merge_preset_lora(model, "dit", path, "transformer", PREFIXES), path)


# ------------------------------------------------------------------------------------------------
# LoRA files: each case once, through both commands


def _lora(path: Path, tensors: dict[str, torch.Tensor], metadata: Any = None) -> Path:
    meta = None if metadata is None else {"lora_adapter_metadata": metadata if isinstance(metadata, str) else json.dumps(metadata)}
    save_file(tensors, str(path), metadata=meta)
    return path


def _pair(head: str = "transformer.", a: Any = None, b: Any = None, tag: str = "") -> dict[str, torch.Tensor]:
    return {f"{head}transformer_blocks.0.to_q.lora_A{tag}.weight": torch.randn(2, 8) if a is None else a,
            f"{head}transformer_blocks.0.to_q.lora_B{tag}.weight": torch.randn(8, 2) if b is None else b}


LORA_CASES = {
    "a-0-d-tensor": (lambda p: _lora(p, _pair(a=torch.tensor(2.0))), "transformer_blocks.0.to_q.lora_A.weight is [] float32, not 2-D"),
    "metadata-a-json-list": (lambda p: _lora(p, _pair(), "[4, 2]"), "lora_adapter_metadata in the file's header is a list, not a JSON object"),
    "header-metadata-a-list": (lambda p: _raw_header(p, {"__metadata__": ["x"]}), "__metadata__) is a list, not a JSON object of strings"),
    "metadata-not-json": (lambda p: _lora(p, _pair(), "{alpha"), "lora_adapter_metadata in the file's header is not JSON"),
    "alpha-a-word": (lambda p: _lora(p, _pair(), {"transformer.lora_alpha": "eight"}), "transformer.lora_alpha in the file's header is \"eight\", not a positive finite number"),
    "alpha-zero": (lambda p: _lora(p, _pair(), {"lora_alpha": 0}), "lora_alpha in the file's header is 0"),
    "alpha-of-400-digits": (lambda p: _lora(p, _pair(), {"lora_alpha": 10**400}), "not a positive finite number"),
    "alpha-nan": (lambda p: _lora(p, _pair(), '{"lora_alpha": NaN}'), "NaN is not a JSON number"),
    "alpha-tensor-negative": (lambda p: _lora(p, {**_pair(), "transformer.transformer_blocks.0.to_q.alpha": torch.tensor(-1.0)}),
                              "alpha transformer.transformer_blocks.0.to_q.alpha is -1.0, not a positive finite number"),
    "a-rank-the-tensors-lack": (lambda p: _lora(p, _pair(), {"transformer.r": 4}), "the header gives dit's LoRA rank 4, its tensors have rank 2"),
    "a-unet-prefix": (lambda p: _lora(p, _pair("unet.")), "LoRA keys under 'unet.' (e.g. unet.transformer_blocks.0.to_q.lora_A.weight) belong to no model of this family; its prefixes are transformer., "),
    "a-pipe-prefix-of-no-slot": (lambda p: _lora(p, _pair("pipe.unet.", tag=".default")), "LoRA keys under 'pipe.unet.'"),
    "integer-weights": (lambda p: _lora(p, _pair(a=torch.ones(2, 8, dtype=torch.int64))), "is [2, 8] int64, not floating"),
    "ranks-that-differ": (lambda p: _lora(p, _pair(b=torch.randn(8, 3))), "their ranks differ"),
    "nan-weights": (lambda p: _lora(p, _pair(b=torch.full((8, 2), float("nan")))), "holds NaN or infinite values"),
    "another-adapter-name": (lambda p: _lora(p, {"transformer.x.lora_A.mine.weight": torch.randn(2, 8)}), "another adapter name"),
    "no-lora-keys": (lambda p: _lora(p, {"transformer.proj_out.weight": torch.randn(4, 8)}), "holds no LoRA weights (no keys"),
    "only-another-models-lora": (lambda p: _lora(p, _pair("text_encoder.")), "holds no LoRA weights of dit; it holds LoRA weights of text_encoder"),
    "truncated": (lambda p: p.write_bytes(_lora(p, _pair()).read_bytes()[:-9]), "truncated: its tensors need"),
    "not-safetensors": (lambda p: p.write_bytes(b"PK\x03\x04 a zip file"), "not a safetensors file"),
    "empty": (lambda p: p.write_bytes(b""), "not a safetensors file (0 bytes"),
}


def _raw_header(path: Path, header: dict[str, Any]) -> Path:
    text = json.dumps(header).encode()
    path.write_bytes(len(text).to_bytes(8, "little") + text)
    return path


@pytest.mark.parametrize("case", list(LORA_CASES))
def test_each_bad_lora_file_is_one_line_in_lora_convert_and_lora_checkpoint(tmp_path, capsys, case):
    make, fragment = LORA_CASES[case]
    path = tmp_path / "in.safetensors"
    make(path)
    before = path.read_bytes()
    code, _, err = cli(capsys, "lora", "convert", str(path), str(tmp_path / "out.safetensors"), "--to", "diffsynth")
    one_error_line(code, err, str(path), fragment)
    assert not (tmp_path / "out.safetensors").exists() and path.read_bytes() == before
    model = lora_dit()
    with pytest.raises(BackendError) as err:
        load_lora_checkpoint(model, "dit", path, PREFIXES)
    assert err.value.source == str(path) and fragment in err.value.one_line()


def test_good_lora_files_of_every_prefix_convert_and_load(tmp_path):
    ours = _pair(a=torch.randn(2, 8), b=torch.randn(8, 2))
    a, b = ours["transformer.transformer_blocks.0.to_q.lora_A.weight"], ours["transformer.transformer_blocks.0.to_q.lora_B.weight"]
    for n, (head, tag) in enumerate([("transformer.", ""), ("pipe.dit.", ".default"), ("", ".default"), ("", ""),
                                     ("diffusion_model.", ""), ("dit.", ".default")]):
        path = _lora(tmp_path / f"{n}.safetensors", _pair(head, a, b, tag), {"transformer.lora_alpha": 4, "transformer.r": 2})
        lora = read_lora_file(path, "dit", PREFIXES)
        scale = 1.0 if lora.layout == "diffsynth" else 2.0
        assert lora.modules == ["transformer_blocks.0.to_q"] and lora.scales == {"transformer_blocks.0.to_q": scale}
        assert torch.equal(lora.weights["transformer_blocks.0.to_q.lora_A.weight"], a)
        convert(path, tmp_path / f"{n}.ds.safetensors", "diffsynth", "dit", PREFIXES)
        assert set(load_file(str(tmp_path / f"{n}.ds.safetensors"))) == {
            "pipe.dit.transformer_blocks.0.to_q.lora_A.default.weight", "pipe.dit.transformer_blocks.0.to_q.lora_B.default.weight"}
    # a text encoder's LoRA saved without a prefix (DiffSynth's --remove_prefix_in_ckpt pipe.text_encoder.): its
    # modules start with the encoder's own top-level names (`model.`, `text_model.`), never taken for a foreign prefix
    for root in ("model", "text_model", "encoder"):
        path = _lora(tmp_path / f"{root}.safetensors", _pair(f"{root}.", tag=".default"))
        assert read_lora_file(path, "text_encoder", PREFIXES).modules == [f"{root}.transformer_blocks.0.to_q"]
    path = _lora(tmp_path / "te.safetensors", _pair("pipe.text_encoder.", tag=".default"))
    with pytest.raises(BackendError, match="holds no LoRA weights of dit; it holds LoRA weights of text_encoder"):
        read_lora_file(path, "dit", PREFIXES)


# ------------------------------------------------------------------------------------------------
# end to end: a split run with a validation prompt gives a cache, encoded prompts and training states


@pytest.fixture(scope="module")
def split(tiny, tmp_path_factory):
    """(output folder, argv) of a finished split run with two validation prompts and a state at each step."""
    from unitgraph.backends.diffusion.data.dataset import write_synthetic_dataset
    from unitgraph.cli.app import main

    root = tmp_path_factory.mktemp("split")
    data = root / "data"
    write_synthetic_dataset(data, count=2, size=SIZE, seed=5)
    argv = ["train", "--task", "sft:split", "--model_paths", str(tiny), "--lora_base_model", "dit", "--lora_rank", "2",
            "--max_pixels", str(SIZE * SIZE), "--dataset_base_path", str(data), "--dataset_metadata_path",
            str(data / "metadata.csv"), "--output_path", str(root / "out"), "--no-progress", "--no-plot", "--seed", "3",
            "--save_steps", "1", "--validation_prompt", "a red circle", "--validation_prompt", "two blue squares",
            "--validation_steps", "1000"]
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert not exc.value.code
    return root / "out", argv


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_a_damaged_state_stops_resume_before_loss_csv_or_a_state_changes(split, tmp_path, capsys):
    out, argv = split
    loss, kept = (out / "loss.csv").read_bytes(), _snapshot(out / "state")
    assert len(read_loss_csv(out / "loss.csv")) == 2

    def rows(state: Path) -> None:  # the case that once cut loss.csv before the traceback
        STATE_CASES["a-loss-that-is-text"][0](state)

    def wider(state: Path) -> None:
        tensors = load_file(str(state / "trained.safetensors"))
        name = sorted(tensors)[0]
        tensors[name] = torch.zeros(tensors[name].shape[0] + 1, *tensors[name].shape[1:])
        save_file(tensors, str(state / "trained.safetensors"))
        reseal(state, "trained.safetensors")

    for n, (tamper, file, fragment) in enumerate([(rows, "state.json", "loss_rows[0]"),
                                                  (wider, "trained.safetensors", "damaged training state: tensor dit/")]):
        copy = tmp_path / str(n) / "step-2"
        shutil.copytree(states(out)[-1], copy)
        tamper(copy)
        code, _, err = cli(capsys, *argv, "--resume", str(copy))
        one_error_line(code, err, str(copy / file), fragment)
        assert (out / "loss.csv").read_bytes() == loss and _snapshot(out / "state") == kept


def _validation(cache: Path) -> tuple[list[str], str]:
    meta = json.loads(load_file_metadata(cache / VALIDATION_FILE)["unitgraph_validation"])
    return meta["prompts"], Cache(cache).read_manifest().key_inputs_hash


def load_file_metadata(path: Path) -> dict[str, str]:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as handle:
        return handle.metadata()


@pytest.fixture
def cache_copy(split, tmp_path):
    copy = tmp_path / "cache"
    shutil.copytree(split[0] / "cache", copy)
    return copy


@FUZZ
@given(data=st.data())
def test_damaged_encoded_prompts_are_their_values_or_refused_by_stage_2_and_cache_verify(cache_copy, data):
    prompts, key = _validation(cache_copy)
    path = cache_copy / VALIDATION_FILE
    original = path.read_bytes()
    good = load_encoded(cache_copy, prompts, key)
    try:
        raw = bytearray(original)
        header_end = 8 + int.from_bytes(raw[:8], "little")
        limit = header_end - 1 if data.draw(st.booleans()) else len(raw) - 1
        for at, value in data.draw(st.lists(st.tuples(st.integers(0, limit), st.integers(0, 255)), min_size=1, max_size=4)):
            raw[at] = value
        raw = bytes(raw[:data.draw(st.integers(len(raw) - 16, len(raw)))])
        path.write_bytes(raw)
        got = outcome(lambda: load_encoded(cache_copy, prompts, key), path)
        event("refused" if isinstance(got, BackendError) else "read")
        problems = verify_cache(cache_copy)[0]
        if isinstance(got, BackendError):
            assert [p for p in problems if VALIDATION_FILE in p], problems
        else:  # read only when nothing that matters changed (the checksum covers it all)
            assert not problems
            assert [sorted(v) for v in got] == [sorted(v) for v in good]
            assert all(torch.equal(got[i][k], good[i][k]) for i in range(len(good)) for k in good[i])
    finally:
        path.write_bytes(original)


def _reencoded(cache: Path, change: Callable[[list[dict[str, Any]]], None]) -> tuple[list[str], str]:
    """validation.safetensors written again (sealed, as stage 1 writes it) with `change` made to the values."""
    prompts, key = _validation(cache)
    values = load_encoded(cache, prompts, key)
    change(values)
    store_encoded(cache, prompts, key, values)
    return prompts, key


VALIDATION_CASES = {
    "a-wider-embedding": (lambda v: v[0].update(prompt_emb=torch.zeros(1, 5, 17, dtype=v[0]["prompt_emb"].dtype)),
                          "prompt_emb of shape [1, 5, 17], which the denoiser cannot read"),
    "no-batch-dimension": (lambda v: v[1].update(prompt_emb=v[1]["prompt_emb"][0]), "so 3-D with a batch of 1"),
    "a-mask-of-another-length": (lambda v: v[0].update(prompt_emb_mask=v[0]["prompt_emb_mask"][:, :-1]),
                                 "so the leading part of prompt_emb's"),
    "an-integer-embedding": (lambda v: v[0].update(prompt_emb=v[0]["prompt_emb"].to(torch.int64)),
                             "prompt_emb of dtype int64, the cache's entries "),
    "a-float-mask": (lambda v: v[1].update(prompt_emb_mask=v[1]["prompt_emb_mask"].float()),
                     "prompt_emb_mask of dtype float32, the cache's entries int64"),
    "an-output-missing": (lambda v: [x.pop("prompt_emb_mask") for x in v], "the cache's prompt units give prompt_emb, prompt_emb_mask"),
    "an-output-more": (lambda v: [x.update(pooled=torch.zeros(1, 4)) for x in v], "hold pooled, prompt_emb, prompt_emb_mask"),
    "nan": (lambda v: v[0]["prompt_emb"].fill_(float("nan")), "NaN or infinite values in prompt_emb"),
}


@pytest.mark.parametrize("case", list(VALIDATION_CASES))
def test_encoded_prompts_the_denoiser_cannot_read_are_one_line_before_training(cache_copy, case):
    change, fragment = VALIDATION_CASES[case]
    prompts, key = _reencoded(cache_copy, change)
    with pytest.raises(BackendError) as err:
        load_encoded(cache_copy, prompts, key)
    assert err.value.source == str(cache_copy / VALIDATION_FILE) and fragment in err.value.one_line(), err.value.one_line()
    if case != "nan":  # cache verify checks all but the values (it reads no tensors)
        problems = verify_cache(cache_copy)[0]
        assert len(problems) == 1 and fragment in problems[0], problems


def test_a_flipped_bit_in_the_encoded_prompts_is_found_by_cache_verify_and_stage_2(cache_copy, tiny, tmp_path, capsys):
    path = cache_copy / VALIDATION_FILE
    raw = bytearray(path.read_bytes())
    raw[-3] ^= 0x10  # inside the last tensor's bytes
    path.write_bytes(bytes(raw))
    code, _, err = cli(capsys, "cache", "verify", str(cache_copy))
    assert code == 1 and f"{path}: the encoded validation prompts do not match their checksum (corrupted)" in err, err
    code, _, err = cli(capsys, "train", "--task", "sft:train", "--model_paths", str(tiny), "--lora_base_model", "dit",
                       "--lora_rank", "2", "--max_pixels", str(SIZE * SIZE), "--dataset_base_path", str(cache_copy),
                       "--output_path", str(tmp_path / "run"), "--no-progress", "--seed", "3",
                       "--validation_prompt", "a red circle", "--validation_prompt", "two blue squares")
    one_error_line(code, err, str(path), "do not match their checksum (corrupted)", "run stage 1")
    assert not (tmp_path / "run").exists()


def test_encoded_prompts_without_a_checksum_are_refused_and_encoded_again_by_stage_1(split, cache_copy, capsys):
    from safetensors.torch import save

    from unitgraph.backends.diffusion.cache.encoded_prompts import DIGEST_KEY

    path = cache_copy / VALIDATION_FILE
    prompts, key = _validation(cache_copy)
    meta = {k: v for k, v in load_file_metadata(path).items() if k != DIGEST_KEY}
    path.write_bytes(save(load_file(str(path)), metadata=meta))  # as an older unitgraph wrote it
    with pytest.raises(BackendError, match="have no checksum"):
        load_encoded(cache_copy, prompts, key)
    argv = split[1]
    stage1 = [*argv[:argv.index("--output_path")], "--output_path", str(cache_copy), "--no-progress", "--seed", "3",
              "--validation_prompt", "a red circle", "--validation_prompt", "two blue squares"]
    stage1[stage1.index("sft:split")] = "sft:data_process"
    code, _, err = cli(capsys, *stage1)
    assert code == 0, err
    # the two prompts and the empty negative prompt their guidance uses, each encoded once
    assert prompts == ["a red circle", "two blue squares", ""]
    assert DIGEST_KEY in load_file_metadata(path) and len(load_encoded(cache_copy, prompts, key)) == 3


def test_a_lora_checkpoint_of_a_foreign_prefix_stops_training_before_it_starts(cache_copy, tiny, tmp_path, capsys):
    lora = _lora(tmp_path / "unet.safetensors", _pair("unet."))
    code, _, err = cli(capsys, "train", "--task", "sft:train", "--model_paths", str(tiny), "--lora_base_model", "dit",
                       "--lora_rank", "2", "--max_pixels", str(SIZE * SIZE), "--dataset_base_path", str(cache_copy),
                       "--output_path", str(tmp_path / "run"), "--no-progress", "--lora_checkpoint", str(lora))
    one_error_line(code, err, str(lora), "LoRA keys under 'unet.'", "transformer.")
    assert not (tmp_path / "run").exists()
