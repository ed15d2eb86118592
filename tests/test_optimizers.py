"""--optimizer and --optimizer_args (backends/diffusion/train/optimizers.py): every optimizer installed here trains
split exactly as unsplit, resumes bit for bit after an interruption, is planned with its own state bytes by the dry
run, and bad input is one line (exit 2) with nothing written.

Each optimizer runs three tiny Qwen-Image jobs in this process (6 steps each): the unsplit run, stage 2 from one
shared stage-1 cache with a state at every step, and that stage 2 resumed from its state after step 2 with what it
made later deleted (as a kill right after that state leaves it). bitsandbytes' AdamW8bit needs CUDA: only its
refusal on this CPU and its planned bytes are tested. Under FSDP2 (two processes, one launch) schedule-free AdamW
trains split as unsplit and resumes exactly; the optimizers FSDP2 cannot take are one line.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("diffusers")

from safetensors.torch import load_file  # noqa: E402

from clitools import cli, one_error_line  # noqa: E402
from unitgraph.backends.diffusion.args import make_args  # noqa: E402
from unitgraph.backends.diffusion.config import RunConfig  # noqa: E402
from unitgraph.backends.diffusion.data.dataset import write_synthetic_dataset  # noqa: E402
from unitgraph.backends.diffusion.memory_plan import format_memory_plan, memory_plan  # noqa: E402
from unitgraph.backends.diffusion.session import plan_for  # noqa: E402
from unitgraph.backends.diffusion.train import optimizers  # noqa: E402
from unitgraph.backends.diffusion.train.loop import read_loss_csv  # noqa: E402
from unitgraph.backends.diffusion.train.resume import states  # noqa: E402

SIZE = 32
INSTALLED = [name for name, spec in optimizers.OPTIMIZERS.items()
             if not spec.cuda and __import__("importlib").util.find_spec(spec.module.split(".")[0])]
RATES = {"prodigy": "1.0"}  # Prodigy's rate is a multiplier of the step size it finds


@pytest.fixture(scope="module")
def job(tiny, tmp_path_factory):
    """The data and one stage-1 cache, shared by every optimizer's runs."""
    root = tmp_path_factory.mktemp("optimizers")
    data = root / "data"
    write_synthetic_dataset(data, count=3, size=SIZE, seed=2)
    return tiny, data, root


def argv(job, out: Path, task: str, optimizer: str, *extra: str) -> list[str]:
    tiny, data, root = job
    source = (["--dataset_base_path", str(root / "cache")] if task.endswith(":train") else
              ["--dataset_base_path", str(data), "--dataset_metadata_path", str(data / "metadata.csv")])
    return ["train", "--task", task, "--model_paths", str(tiny), *source, "--lora_base_model", "dit",
            "--lora_rank", "4", "--max_pixels", str(SIZE * SIZE), "--num_epochs", "2", "--save_steps", "1",
            "--save_total_limit", "0", "--learning_rate", RATES.get(optimizer, "1e-3"), "--output_path", str(out),
            "--no-progress", "--no-plot", "--seed", "3", "--optimizer", optimizer, *extra]


@pytest.fixture(scope="module")
def cache(job):
    tiny, data, root = job
    from unitgraph.cli.app import main

    with pytest.raises(SystemExit) as exc:
        main(["train", "--task", "sft:data_process", "--model_paths", str(tiny), "--lora_base_model", "dit",
              "--max_pixels", str(SIZE * SIZE), "--dataset_base_path", str(data), "--dataset_metadata_path",
              str(data / "metadata.csv"), "--output_path", str(root / "cache"), "--no-progress", "--seed", "3"])
    assert not exc.value.code
    return root / "cache"


def same_run(a: Path, b: Path) -> None:
    """The same losses, bit for bit, and the same final weights."""
    ra, rb = read_loss_csv(a / "loss.csv"), read_loss_csv(b / "loss.csv")
    assert len(ra) == 6 and [(r["step"], r["loss"]) for r in ra] == [(r["step"], r["loss"]) for r in rb]
    wa, wb = load_file(str(a / "epoch-1.safetensors")), load_file(str(b / "epoch-1.safetensors"))
    assert set(wa) == set(wb) and wa
    for key in wa:
        assert torch.equal(wa[key], wb[key]), key


@pytest.mark.parametrize("name", INSTALLED)
def test_split_equals_unsplit_and_a_resume_is_the_uninterrupted_run(job, cache, name, capsys):
    root = job[2]
    whole, split = root / f"{name}-unsplit", root / f"{name}-split"
    code, _, err = cli(capsys, *argv(job, whole, "sft", name))
    assert code == 0, err
    code, _, err = cli(capsys, *argv(job, split, "sft:train", name))
    assert code == 0, err
    same_run(whole, split)
    first = load_file(str(split / "step-1.safetensors"))
    assert any(not torch.equal(first[k], v) for k, v in load_file(str(split / "epoch-1.safetensors")).items())
    record = json.loads((states(split)[1] / "state.json").read_text())
    assert record["match"]["optimizer"] == name and record["step"] == 2
    # interrupted right after the state of step 2: what the run made later is gone
    for state in states(split)[2:]:
        shutil.rmtree(state)
    for step in range(3, 7):
        (split / f"step-{step}.safetensors").unlink()
    for epoch in (0, 1):
        (split / f"epoch-{epoch}.safetensors").unlink()
    code, out, err = cli(capsys, *argv(job, split, "sft:train", name, "--resume"))
    assert code == 0, err
    assert "resuming from" in out and "step 2" in out
    same_run(whole, split)
    # another optimizer does not continue this state
    other = "adamw" if name != "adamw" else "came"
    flags = argv(job, split, "sft:train", name, "--resume")
    flags[flags.index("--optimizer") + 1] = other
    code, _, err = cli(capsys, *flags)
    one_error_line(code, err, "another optimizer", "--optimizer")


def test_the_state_holds_each_piece_the_optimizer_keeps(job, cache, capsys):
    """Adafactor's step counts are numbers of state.json, its factors tensors of their own shapes; a state whose
    pieces do not fit the optimizer is one line, and AdamW's states are as they always were."""
    root = job[2]
    out = root / "adafactor-pieces"
    code, _, err = cli(capsys, *argv(job, out, "sft:train", "adafactor", "--num_epochs", "1"))
    assert code == 0, err
    state = states(out)[-1]
    record = json.loads((state / "state.json").read_text())
    assert record["optimizer_scalars"]["0.step"] == 3
    from safetensors import safe_open

    with safe_open(str(state / "optimizer.safetensors"), "pt") as f:
        names = {k.split(".", 1)[1] for k in f.keys()}
    assert {"RMS", "exp_avg_sq_row", "exp_avg_sq_col"} <= names and "step" not in names
    record["optimizer_scalars"]["0.step"] = 2.5
    (state / "state.json").write_text(json.dumps(record))
    code, _, err = cli(capsys, *argv(job, out, "sft:train", "adafactor", "--num_epochs", "2", "--resume"))
    one_error_line(code, err, "0.step is 2.5, not a step count")
    adamw = json.loads((states(root / "adamw-split")[-1] / "state.json").read_text())
    assert "optimizer_scalars" not in adamw


BAD = [
    (["--optimizer", "sgd"], ["--optimizer must be one of adamw, adamw8bit, adafactor, prodigy, came, schedulefree"]),
    (["--optimizer", "came", "--optimizer_args", "betas"], ["'betas' is not key=value", "betas=0.9:0.999"]),
    (["--optimizer", "came", "--optimizer_args", "momentum=0.9"], ["CAME takes no argument 'momentum'"]),
    (["--optimizer", "prodigy", "--optimizer_args", "lr=1"], ["lr is set by --learning_rate"]),
    (["--optimizer", "came", "--optimizer_args", "betas=0.9:x:0.99"], ["CAME refuses them"]),
    (["--optimizer", "adafactor", "--optimizer_args", "relative_step=true"], ["Adafactor would then set its own rate"]),
    (["--optimizer", "adamw8bit"], ["runs on CUDA devices only", "pip install bitsandbytes"]),
    (["--customized_optimizer", "torch.optim.SGD"], ["--customized_optimizer", "--optimizer"]),
]


@pytest.mark.parametrize("flags, fragments", BAD, ids=[" ".join(f) for f, _ in BAD])
def test_bad_input_is_one_line_and_nothing_is_written(job, tmp_path, capsys, monkeypatch, flags, fragments):
    monkeypatch.setenv("ACCELERATE_USE_CPU", "true")
    out = tmp_path / "out"
    code, _, err = cli(capsys, *argv(job, out, "sft:split", "adamw")[:-2], *flags)
    one_error_line(code, err, *fragments)
    assert not out.exists()


def test_a_missing_library_is_named(job, tmp_path, capsys, monkeypatch):
    real = optimizers.importlib.util.find_spec
    monkeypatch.setattr(optimizers.importlib.util, "find_spec", lambda name, *a: None if name == "prodigyopt"
                        else real(name, *a))
    out = tmp_path / "out"
    code, _, err = cli(capsys, *argv(job, out, "sft:split", "prodigy"))
    one_error_line(code, err, "--optimizer prodigy needs the prodigyopt package: pip install prodigyopt")
    assert not out.exists()


def test_an_engine_trains_with_adamw_only(job, tmp_path, capsys):
    config = tmp_path / "fsdp2.yaml"
    config.write_text("distributed_type: FSDP\nfsdp_config:\n  fsdp_version: 2\nmixed_precision: 'no'\n"
                      "num_machines: 1\nnum_processes: 2\n")
    code, _, err = cli(capsys, *argv(job, tmp_path / "out", "sft:split", "came"), "--dry_run", "--config_file",
                       str(config))
    one_error_line(code, err, "--optimizer came with FSDP2", "came-pytorch's RuntimeError", "adamw or schedulefree")


def test_the_optimizer_args_syntax():
    parse = optimizers.parse_optimizer_args
    assert parse("betas=0.9:0.999,eps=1e-8,foreach=false,beta3=null,name=x") == \
        {"betas": [0.9, 0.999], "eps": 1e-8, "foreach": False, "beta3": None, "name": "x"}
    assert parse("d_coef=2,safeguard_warmup=True") == {"d_coef": 2, "safeguard_warmup": True}
    assert parse(None) == parse("") == {}
    assert parse("growth_rate=Infinity") == {"growth_rate": "Infinity"}  # not a JSON number: left a string


def planned(tiny: Path, name: str, **flags) -> dict:
    args = dict(model_paths=str(tiny), dataset_base_path=str(tiny), lora_base_model="dit",
                lora_target_modules="to_q,to_k,to_v,to_out.0", lora_rank=4, max_pixels=64 * 64, progress=False,
                mixed_precision="bf16", optimizer=name, dry_run=True, **flags)
    cfg = RunConfig.from_args(make_args(**args))
    return memory_plan(cfg, plan_for(cfg))


def measured_state_bytes(name: str, shapes: list[tuple[int, ...]]) -> int:
    """Bytes of every tensor the optimizer keeps after two steps over fp32 parameters of these shapes (numbers
    such as step counts, and tensors of one element, left out as the plan leaves them)."""
    params = [torch.nn.Parameter(torch.randn(shape)) for shape in shapes]
    opt = optimizers.build_optimizer(name, {}, params, 1e-3, 0.01)
    for _ in range(2):
        for p in params:
            p.grad = torch.randn_like(p)
        opt.step()
    return sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values()
               if isinstance(v, torch.Tensor) and v.numel() > 1)


@pytest.mark.parametrize("name", list(optimizers.OPTIMIZERS))
def test_the_dry_run_plans_each_optimizers_state(tiny, name):
    plan = planned(tiny, name)
    adamw = planned(tiny, "adamw") if name != "adamw" else plan
    train = plan["stages"]["train"]
    lora = train["models"]["dit"]["trainable_params"]
    assert adamw["stages"]["train"]["trainable_bytes"] == 16 * lora  # as it always was
    from unitgraph.backends.diffusion.memory_plan import build_meta  # noqa: F401  (the plan's own models)

    cfg = RunConfig.from_args(make_args(model_paths=str(tiny), dataset_base_path=str(tiny), lora_base_model="dit",
                                        lora_target_modules="to_q,to_k,to_v,to_out.0", lora_rank=4, progress=False))
    from unitgraph.backends.diffusion.models.stage import load_models
    from unitgraph.backends.diffusion.models.lora import add_lora

    dit = load_models(cfg, ["dit"], training=True, device="cpu")["dit"]
    add_lora(dit, "dit", ["to_q", "to_k", "to_v", "to_out.0"], 4, 4, 0)
    shapes = [tuple(p.shape) for p in dit.parameters() if p.requires_grad]
    assert sum(map(lambda s: torch.Size(s).numel(), shapes)) == lora
    expected = 8 * lora + sum(optimizers.state_bytes(name, {}, s) for s in shapes)
    assert train["trainable_bytes"] == expected
    if not optimizers.OPTIMIZERS[name].cuda and name in INSTALLED:  # the table's bytes are what the optimizer keeps
        assert expected - 8 * lora == measured_state_bytes(name, shapes)
    label = "AdamW" if name == "adamw" else optimizers.optimizer_label(name)
    assert any(line.split()[:3] == ["trainable", "fp32", "+"] and line.split()[3] == label
               for line in format_memory_plan(plan))


FSDP2_YAML = """compute_environment: LOCAL_MACHINE
distributed_type: FSDP
fsdp_config:
  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP
  fsdp_offload_params: false
  fsdp_reshard_after_forward: true
  fsdp_state_dict_type: SHARDED_STATE_DICT
  fsdp_version: 2
mixed_precision: 'no'
num_machines: 1
num_processes: 2
"""


@pytest.mark.slow
def test_schedulefree_under_fsdp2_splits_as_unsplit_and_resumes_exactly(job, tmp_path):
    """Under FSDP2 schedule-free AdamW keeps only tensors of its parameters' shapes, sharded as they are: two
    processes train split as unsplit, and a run stopped after its first epoch continues to the same numbers."""
    import os
    import subprocess
    import sys

    tiny, data, _ = job
    (tmp_path / "fsdp2.yaml").write_text(FSDP2_YAML)
    base = ["train", "--model_paths", str(tiny), "--dataset_base_path", str(data), "--dataset_metadata_path",
            str(data / "metadata.csv"), "--lora_base_model", "dit", "--lora_rank", "4", "--max_pixels",
            str(SIZE * SIZE), "--learning_rate", "1e-3", "--no-progress", "--no-plot", "--seed", "3",
            "--optimizer", "schedulefree", "--save_steps", "1"]
    jobs = [([*base, "--num_epochs", "2"], "whole"), ([*base, "--num_epochs", "2", "--task", "sft:split"], "split"),
            ([*base, "--num_epochs", "1"], "resumed"), ([*base, "--num_epochs", "2", "--resume"], "resumed")]
    spec = tmp_path / "jobs.json"
    spec.write_text(json.dumps([{"argv": a, "output": str(tmp_path / out)} for a, out in jobs]))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ACCELERATE_", "UNITGRAPH_", "FSDP_"))}
    env["OMP_NUM_THREADS"] = "1"
    runner = Path(__file__).parent / "two_process_stage1.py"
    done = subprocess.run([sys.executable, "-m", "accelerate.commands.launch", "--config_file", "fsdp2.yaml",
                           "--num_processes", "2", "--main_process_port", "0", str(runner), str(spec)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600)
    logs = {out: (tmp_path / f"{out}.rank0.out").read_text() for _, out in jobs
            if (tmp_path / f"{out}.rank0.out").exists()}
    assert done.returncode == 0, (logs, done.stderr[-3000:])
    assert "engine: FSDP2" in logs["whole"] and "resuming from" in logs["resumed"]
    for other in ("split", "resumed"):
        a, b = read_loss_csv(tmp_path / "whole" / "loss.csv"), read_loss_csv(tmp_path / other / "loss.csv")
        assert [r["loss"] for r in a] == [r["loss"] for r in b] and a
        wa, wb = load_file(str(tmp_path / "whole" / "epoch-1.safetensors")), \
            load_file(str(tmp_path / other / "epoch-1.safetensors"))
        assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa), other
