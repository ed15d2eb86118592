"""The memory plan of `unitgraph train --dry_run` (backends/diffusion/memory_plan.py), from config files alone.

What matters, checked on the test-size Qwen-Image models and the released configs:
- the plan's JSON shape, and a peak that is its weights + trainable state + activations;
- weight bytes are what the run loads: each slot's bytes per dtype equal those of the model `load_models` and
  `prepare_models` hold (bf16, fp32, fp8 storage), and fp32 is twice bf16;
- --fp8_models lowers the named slot only; stage 2 of a DiT LoRA holds no frozen encoder; checkpointing lowers
  the activations;
- a folder of config.json files (weights deleted) gives the same plan; a folder without them is one line;
- the estimate against one real step on this CPU: the storages it creates equal the trace's, and the heap in use
  exceeds the estimate by less than 1 MiB at test size (the Python and autograd objects of the step);
- `tiny-models --size real` writes the released configs, which build on meta to the published sizes.
"""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("diffusers")
pytest.importorskip("peft")

from clitools import cli, one_error_line  # noqa: E402
from unitgraph.backends.diffusion.args import make_args  # noqa: E402
from unitgraph.backends.diffusion.config import RunConfig  # noqa: E402
from unitgraph.backends.diffusion.errors import BackendError  # noqa: E402
from unitgraph.backends.diffusion.memory_plan import build_meta, format_memory_plan, memory_plan  # noqa: E402
from unitgraph.backends.diffusion.models.precision import FP8_SKIP_PATTERNS  # noqa: E402
from unitgraph.backends.diffusion.models.sources import ModelSources  # noqa: E402
from unitgraph.backends.diffusion.registry import families  # noqa: E402
from unitgraph.backends.diffusion.session import plan_for  # noqa: E402
from shallow import shallow  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
TARGETS = "to_q,to_k,to_v,to_out.0"
MIB = 1 << 20


def run_config(folder: Path, **flags) -> RunConfig:
    kwargs = dict(model_paths=str(folder), dataset_base_path=str(folder), lora_base_model="dit",
                  lora_target_modules=TARGETS, lora_rank=4, max_pixels=64 * 64, progress=False,
                  mixed_precision="bf16")  # the plans of GPU runs, whatever this machine's default is
    kwargs.update(flags)
    return RunConfig.from_args(make_args(**kwargs))


def plan_of(folder: Path, **flags) -> dict:
    cfg = run_config(folder, **flags)
    return memory_plan(cfg, plan_for(cfg))


@pytest.fixture(scope="module")
def bf16(tiny) -> dict:
    return plan_of(tiny)


def test_the_plan_is_json_with_a_peak_of_its_parts(bf16):
    assert set(bf16["stages"]) == {"data_process", "train", "unsplit"}
    json.loads(json.dumps(bf16))
    for stage in bf16["stages"].values():
        for key in ("peak_bytes", "trainable_bytes", "activation_bytes"):
            assert isinstance(stage[key], int) and stage[key] >= 0, key
        assert stage["models"]
        for model in stage["models"].values():
            assert isinstance(model["dtype"], str) and isinstance(model["weight_bytes"], int)
        weights = sum(m["weight_bytes"] for m in stage["models"].values())
        assert stage["peak_bytes"] == weights + stage["trainable_bytes"] + stage["activation_bytes"]
    assert bf16["settings"]["compute_dtype"] == "bfloat16"
    assert bf16["settings"]["size"]["image_tokens"] == 64  # 64 px, VAE /4, 2x2 patches
    lines = format_memory_plan(bf16)
    assert any(line.startswith("stage 2 (train): peak ") for line in lines)
    assert all(re.search(r"\d+\.\d\d GiB", line) for line in lines if "GiB" in line and not line.startswith("note:"))


def test_stage2_of_a_dit_lora_holds_no_frozen_encoder(bf16):
    stages = bf16["stages"]
    assert set(stages["train"]["models"]) == {"dit"}
    assert set(stages["data_process"]["models"]) == {"text_encoder", "vae"}
    assert set(stages["unsplit"]["models"]) == {"dit", "text_encoder", "vae"}
    assert stages["data_process"]["trainable_bytes"] == 0 and stages["train"]["trainable_bytes"] > 0
    lora = stages["train"]["models"]["dit"]["trainable_params"]
    assert stages["train"]["trainable_bytes"] == 16 * lora  # fp32 value, gradient, AdamW's two moments


def _loaded_bytes(cfg: RunConfig, slots, training: bool) -> dict:
    """{slot: {dtype: bytes of its frozen parameters}} of the models a run really holds."""
    from unitgraph.backends.diffusion.models.stage import load_models
    from unitgraph.backends.diffusion.session import make_accelerator
    from unitgraph.backends.diffusion.train.loop import prepare_models

    models = load_models(cfg, slots, training=training, device="cpu")
    if training:
        models, _, _ = prepare_models(cfg, plan_for(cfg), models, make_accelerator(cfg))
    out = {}
    for slot in slots:
        model = getattr(models[slot], "module", models[slot])
        counts: dict = {}
        for p in model.parameters():
            if not p.requires_grad:
                name = str(p.dtype).replace("torch.", "")
                counts[name] = counts.get(name, 0) + p.numel() * p.element_size()
        out[slot] = counts
    return out


@pytest.mark.parametrize("flags", [{}, {"mixed_precision": "no"}, {"fp8_models": "dit,text_encoder"}],
                         ids=["bf16", "fp32", "fp8"])
def test_weight_bytes_are_what_the_run_loads(tiny, flags):
    cfg = run_config(tiny, **flags)
    plan = memory_plan(cfg, plan_for(cfg))
    stage1 = _loaded_bytes(cfg, ["text_encoder", "vae"], training=False)
    stage2 = _loaded_bytes(cfg, ["dit"], training=True)
    for slot, counts in stage1.items():
        assert plan["stages"]["data_process"]["models"][slot]["bytes_by_dtype"] == counts, slot
    assert plan["stages"]["train"]["models"]["dit"]["bytes_by_dtype"] == stage2["dit"]


def _fp8_bytes(model, compute_bytes: int) -> int:
    """Bytes of a model stored as `store_fp8` says: outside FP8_SKIP_PATTERNS (matched on the module names down the
    tree), a Linear layer's weight in 1 byte (its bias in the compute dtype), a Conv or Embedding layer's
    parameters in 1 byte; everything else in the compute dtype."""
    convs = (torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d, torch.nn.Embedding)
    fp8 = 0
    for name, module in model.named_modules():
        parts = name.split(".")
        prefixes = [".".join(parts[:i]) for i in range(1, len(parts) + 1)] if name else []
        if any(re.search(p, q) for p in FP8_SKIP_PATTERNS for q in prefixes):
            continue
        if type(module) is torch.nn.Linear:
            fp8 += module.weight.numel()
        elif isinstance(module, convs):
            fp8 += sum(p.numel() for p in module.parameters(recurse=False))
    total = sum(p.numel() for p in model.parameters())
    return fp8 + (total - fp8) * compute_bytes


def test_bytes_follow_the_dtype_of_each_parameter_of_the_built_model(tiny):
    """fp32 is exactly twice bf16 (no keep-in-fp32 modules in Qwen-Image), fp8 stores 1 byte per weight of the
    layers the casting reaches; each against the meta model counted here."""
    family = {f.name: f for f in families()}["qwen_image"]
    sources = ModelSources(family.slots, str(tiny), offline=True)
    plans = {name: plan_of(tiny, **flags) for name, flags in
             (("fp32", {"mixed_precision": "no"}), ("bf16", {}), ("fp8", {"fp8_models": "dit,text_encoder"}))}
    for slot, stage in (("text_encoder", "data_process"), ("vae", "data_process"), ("dit", "train")):
        meta = build_meta(family.slot(slot), sources.load_config(slot), "float32")
        params = sum(p.numel() for p in meta.parameters())
        bytes_of = {name: p["stages"][stage]["models"][slot]["weight_bytes"] for name, p in plans.items()}
        assert bytes_of["fp32"] == 4 * params and bytes_of["bf16"] == 2 * params, slot
        if slot != "vae":
            assert bytes_of["fp8"] == _fp8_bytes(meta, 2) < bytes_of["bf16"], slot
        else:
            assert bytes_of["fp8"] == bytes_of["bf16"]


def test_fp8_lowers_only_the_named_slot(tiny, bf16):
    fp8 = plan_of(tiny, fp8_models="text_encoder")
    for stage in ("data_process", "unsplit"):
        ours, theirs = fp8["stages"][stage]["models"], bf16["stages"][stage]["models"]
        assert ours["text_encoder"]["weight_bytes"] < theirs["text_encoder"]["weight_bytes"]
        assert ours["text_encoder"]["dtype"] == "float8_e4m3fn"
        assert ours["vae"]["weight_bytes"] == theirs["vae"]["weight_bytes"]
    for stage in ("train", "unsplit"):
        assert fp8["stages"][stage]["models"]["dit"] == bf16["stages"][stage]["models"]["dit"]


def test_checkpointing_lowers_the_activations(tiny, bf16):
    checkpointed = plan_of(tiny, use_gradient_checkpointing=True)
    train, before = checkpointed["stages"]["train"], bf16["stages"]["train"]
    assert train["activation_bytes"] < before["activation_bytes"]
    assert train["weight_bytes"] == before["weight_bytes"] and train["trainable_bytes"] == before["trainable_bytes"]
    offloaded = plan_of(tiny, use_gradient_checkpointing_offload=True)["stages"]["train"]
    assert offloaded["activation_bytes"] <= train["activation_bytes"] and offloaded["host_bytes"] > 0


def test_a_folder_of_config_files_alone_gives_the_same_plan(tiny, tmp_path, bf16):
    folder = tmp_path / "configs"
    shutil.copytree(tiny, folder)
    removed = [p for p in folder.rglob("*") if p.suffix == ".safetensors"]
    for path in removed:
        path.unlink()
    shutil.rmtree(folder / "tokenizer")
    assert removed
    before = sorted((p, p.stat().st_mtime_ns) for p in tmp_path.rglob("*"))
    assert plan_of(folder)["stages"] == bf16["stages"]
    assert sorted((p, p.stat().st_mtime_ns) for p in tmp_path.rglob("*")) == before  # nothing written


def test_a_folder_without_config_files_is_one_line(tiny, tmp_path):
    folder = tmp_path / "no-config"
    shutil.copytree(tiny, folder)
    (folder / "transformer" / "config.json").unlink()
    with pytest.raises(BackendError) as exc:
        plan_of(folder)
    text = str(exc.value)
    assert len(text.splitlines()) == 1 and str(folder / "transformer") in text and "config.json" in text


def _benchmark():
    path = ROOT / "benchmarks" / "memory_plan_table.py"
    spec = importlib.util.spec_from_file_location("memory_plan_table", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("memory_plan_table", module)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("flags", [{}, {"use_gradient_checkpointing": True}], ids=["bf16", "checkpointing"])
def test_the_estimate_against_a_measured_step(tiny, flags):
    """One real DiT LoRA step (the run's loading, preparation, loss and backward): the storages it creates are the
    fake trace's within 1 %; the heap in use (mallinfo2 after every op, the step after a warm-up) holds the
    estimate plus less than 1 MiB of the step's Python and autograd objects. (At demo size the error is a figure
    of benchmarks/memory_plan_table.py, in docs/memory.md, not a test's: 0.2-10 % measured.)"""
    bench = _benchmark()
    if bench.heap_reader() is None:
        pytest.skip("glibc's mallinfo2 is not available here")
    result = bench.measure_step("qwen_image", tiny, {"max_pixels": 64 * 64, "lora_target_modules": TARGETS, **flags})
    estimate = result["step"]["estimate"]
    tracked, heap = result["step"]["measured"][-1]
    assert abs(tracked - estimate) <= 0.01 * estimate
    assert estimate <= heap < estimate + MIB
    for slot, encoder in result["encoders"].items():
        tracked, heap = encoder["measured"][-1]
        assert abs(tracked - encoder["estimate"]) <= 0.01 * encoder["estimate"], slot


# published parameter counts (PRECISION_NOTES.md; the releases' model cards)
RELEASES = {
    ("qwen_image", "real"): {"dit": 20.43e9, "text_encoder": 8.29e9, "vae": 0.127e9},
    ("flux", "real"): {"dit": 11.90e9, "text_encoder_2": 4.76e9, "text_encoder_1": 0.123e9, "vae_encoder": 0.084e9},
    ("wan", "real"): {"dit": 14.29e9, "text_encoder": 5.68e9, "vae": 0.127e9},
    ("wan", "real-1.3b"): {"dit": 1.42e9},
    ("wan", "real-a14b"): {"dit": 14.29e9},  # each of Wan 2.2 A14B's experts is a Wan 2.1 14B DiT
}


@pytest.mark.parametrize("family, size", list(RELEASES), ids=[f"{f}-{s}" for f, s in RELEASES])
def test_the_released_configs_build_to_the_published_sizes(capsys, tmp_path, family, size):
    fam = {f.name: f for f in families()}[family]
    code, out, err = cli(capsys, "tiny-models", str(tmp_path / "real"), "--pipeline", family, "--size", size)
    assert code == 0, err
    assert "no weights" in out and not list((tmp_path / "real").rglob("*.safetensors"))
    sources = ModelSources(fam.slots, str(tmp_path / "real"), offline=True)
    for slot, published in RELEASES[(family, size)].items():
        model = build_meta(fam.slot(slot), sources.load_config(slot), "bfloat16")
        count = sum(p.numel() for p in model.parameters())
        assert abs(count - published) < 0.005 * published, (slot, count)


def test_an_unknown_real_size_is_one_line(capsys, tmp_path):
    code, _, err = cli(capsys, "tiny-models", str(tmp_path / "x"), "--pipeline", "flux", "--size", "real-9b")
    one_error_line(code, err, "--size must be one of real", "real-9b")
    assert not (tmp_path / "x").exists()


@pytest.mark.slow
def test_qwen_image_at_1024_fits_the_figures_it_should(tmp_path):
    """Qwen-Image's released configs at 1024x1024: fp8 storage and checkpointing each lower stage 2, and stage 2
    holds the DiT alone, far below the unsplit run that holds the 8.3 B-parameter text encoder too."""
    from unitgraph.backends.diffusion.families.qwen_image.real import write_real_configs

    # the DiT at 2 of its 60 blocks (docs/memory.md has the released depth); the text encoder as released
    folder = shallow(write_real_configs(tmp_path / "qwen", "real"), ("transformer",))
    flags = {"lora_target_modules": None, "lora_rank": 32, "height": 1024, "width": 1024}
    bf16 = plan_of(folder, **flags)["stages"]
    fp8 = plan_of(folder, fp8_models="dit", use_gradient_checkpointing=True, **flags)["stages"]
    assert fp8["train"]["peak_bytes"] < bf16["train"]["peak_bytes"]
    assert fp8["train"]["models"]["dit"]["weight_bytes"] < 0.55 * bf16["train"]["models"]["dit"]["weight_bytes"]
    assert fp8["unsplit"]["peak_bytes"] - fp8["train"]["peak_bytes"] > 15 * 2**30  # the text encoder, 8.29 B at bf16


def test_a_plan_made_at_a_cpus_fp32_default_says_so(tiny, monkeypatch):
    """On a CPU without bf16 kernels the run's default is fp32 (config.default_precision): a plan made there without
    --mixed_precision is one of fp32 weights, and says how to plan the GPU's bf16 run."""
    from unitgraph.backends.diffusion import config

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(config, "cpu_has_bf16", lambda: False)
    plan = plan_of(tiny, mixed_precision=None)
    assert plan["settings"]["mixed_precision"] == "no"
    assert any("--mixed_precision bf16 plans that" in note for note in plan["notes"])
    assert not any("plans that" in note for note in plan_of(tiny)["notes"])  # asked for bf16: nothing to say
