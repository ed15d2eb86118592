"""--ema_decay (backends/diffusion/train/ema.py): the moving average of the trained weights is diffusers' EMAModel's,
the same split as unsplit, resumed bit for bit after an interruption, written beside each checkpoint in its layout,
used for validation samples with --validation_use_ema, planned by the dry run; bad input is one line (exit 2).
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
from unitgraph.backends.diffusion.data.dataset import write_synthetic_dataset  # noqa: E402
from unitgraph.backends.diffusion.train.ema import TrainedEMA, ema_decay  # noqa: E402
from unitgraph.backends.diffusion.train.loop import read_loss_csv  # noqa: E402
from unitgraph.backends.diffusion.train.resume import states  # noqa: E402

SIZE = 32
DECAY = "0.9"


@pytest.fixture(scope="module")
def job(tiny, tmp_path_factory):
    root = tmp_path_factory.mktemp("ema")
    data = root / "data"
    write_synthetic_dataset(data, count=3, size=SIZE, seed=2)
    from unitgraph.cli.app import main

    with pytest.raises(SystemExit) as exc:
        main(["train", "--task", "sft:data_process", "--model_paths", str(tiny), "--lora_base_model", "dit",
              "--max_pixels", str(SIZE * SIZE), "--dataset_base_path", str(data), "--dataset_metadata_path",
              str(data / "metadata.csv"), "--output_path", str(root / "cache"), "--no-progress", "--seed", "3"])
    assert not exc.value.code
    return tiny, data, root


def argv(job, out: Path, task: str, *extra: str) -> list[str]:
    tiny, data, root = job
    source = (["--dataset_base_path", str(root / "cache")] if task.endswith(":train") else
              ["--dataset_base_path", str(data), "--dataset_metadata_path", str(data / "metadata.csv")])
    return ["train", "--task", task, "--model_paths", str(tiny), *source, "--lora_base_model", "dit",
            "--lora_rank", "4", "--max_pixels", str(SIZE * SIZE), "--num_epochs", "2", "--save_steps", "1",
            "--save_total_limit", "0", "--learning_rate", "1e-3", "--output_path", str(out), "--no-progress",
            "--no-plot", "--seed", "3", "--ema_decay", DECAY, *extra]


def same_files(a: Path, b: Path) -> None:
    wa, wb = load_file(str(a)), load_file(str(b))
    assert set(wa) == set(wb) and wa
    for key in wa:
        assert torch.equal(wa[key], wb[key]), (a.name, key)


def test_the_average_is_diffusers_emamodels():
    from diffusers.training_utils import EMAModel

    torch.manual_seed(0)
    params = {f"p{i}": torch.nn.Parameter(torch.randn(5, 3)) for i in range(3)}
    ours = TrainedEMA(params, 0.95, "cpu")
    theirs = EMAModel(list(params.values()), decay=0.95)
    for _ in range(40):
        with torch.no_grad():
            for p in params.values():
                p.add_(torch.randn_like(p))
        ours.update(params)
        theirs.step(list(params.values()))
    for ours_value, theirs_value in zip(ours.shadow.values(), theirs.shadow_params):
        assert torch.equal(ours_value, theirs_value)
    assert ema_decay(0.95, 1) == 0.0 and ema_decay(0.95, 400) == 0.95 and ema_decay(0.95, 3) == 3 / 12


@pytest.fixture(scope="module")
def runs(job):
    """The unsplit run and stage 2 with --ema_decay, each with a state and checkpoints at every step."""
    root = job[2]
    from unitgraph.cli.app import main

    made = {}
    for name, task in (("unsplit", "sft"), ("split", "sft:train")):
        with pytest.raises(SystemExit) as exc:
            main(argv(job, root / name, task))
        assert not exc.value.code
        made[name] = root / name
    return made


def test_split_equals_unsplit_and_each_checkpoint_has_its_average_beside_it(runs):
    whole, split = runs["unsplit"], runs["split"]
    assert [r["loss"] for r in read_loss_csv(whole / "loss.csv")] == \
        [r["loss"] for r in read_loss_csv(split / "loss.csv")]
    for step in range(1, 7):
        same_files(whole / f"step-{step}-ema.safetensors", split / f"step-{step}-ema.safetensors")
    same_files(whole / "epoch-1-ema.safetensors", split / "epoch-1-ema.safetensors")
    # the average in the checkpoint's own layout, of the weights after each step (diffusers' decay schedule)
    weights = [load_file(str(whole / f"step-{step}.safetensors")) for step in range(1, 7)]
    ema = load_file(str(whole / "epoch-1-ema.safetensors"))
    assert set(ema) == set(weights[0])
    for key in ema:
        shadow = weights[0][key].clone()
        for n, w in enumerate(weights[1:], start=2):
            shadow.sub_((1 - ema_decay(float(DECAY), n)) * (shadow - w[key]))
        assert torch.equal(ema[key], shadow), key
    assert any(not torch.equal(ema[k], weights[-1][k]) for k in ema)
    record = json.loads((states(whole)[-1] / "state.json").read_text())
    assert record["ema_step"] == 6 and record["match"]["ema_decay"] == float(DECAY)


def test_an_interrupted_run_resumes_its_average_exactly(job, runs, capsys):
    split = runs["split"]
    resumed = job[2] / "resumed"
    shutil.copytree(split, resumed)
    for state in states(resumed)[2:]:  # killed right after the state of step 2
        shutil.rmtree(state)
    for path in resumed.glob("*.safetensors"):
        if not path.name.startswith(("step-1", "step-2")):
            path.unlink()
    code, out, err = cli(capsys, *argv(job, resumed, "sft:train", "--resume"))
    assert code == 0, err
    assert "resuming from" in out and "step 2" in out
    for name in ("epoch-1.safetensors", "epoch-1-ema.safetensors", "step-5-ema.safetensors"):
        same_files(split / name, resumed / name)
    same_files(states(split)[-1] / "ema.safetensors", states(resumed)[-1] / "ema.safetensors")
    # another decay would be another average: refused in one line
    flags = argv(job, resumed, "sft:train", "--resume")
    flags[flags.index("--ema_decay") + 1] = "0.99"
    code, _, err = cli(capsys, *flags)
    one_error_line(code, err, "another ema_decay", "--ema_decay")


def test_validation_samples_with_the_average(job, tmp_path, capsys):
    """--validation_use_ema renders the average and leaves the training as it was."""
    extra = ("--num_epochs", "1", "--validation_prompt", "a red square", "--validation_inference_steps", "2")
    code, _, err = cli(capsys, *argv(job, tmp_path / "plain", "sft", *extra))
    assert code == 0, err
    code, _, err = cli(capsys, *argv(job, tmp_path / "ema", "sft", *extra, "--validation_use_ema"))
    assert code == 0, err
    plain, ema = tmp_path / "plain", tmp_path / "ema"
    assert read_loss_csv(plain / "loss.csv") and \
        [r["loss"] for r in read_loss_csv(plain / "loss.csv")] == [r["loss"] for r in read_loss_csv(ema / "loss.csv")]
    same_files(plain / "epoch-0.safetensors", ema / "epoch-0.safetensors")
    assert (plain / "samples" / "step-1" / "0.png").read_bytes() == (ema / "samples" / "step-1" / "0.png").read_bytes()
    assert (plain / "samples" / "epoch-0" / "0.png").read_bytes() != \
        (ema / "samples" / "epoch-0" / "0.png").read_bytes()


BAD = [
    (["--ema_decay", "1"], ["--ema_decay must be a number between 0 and 1"]),
    (["--ema_decay", "0"], ["--ema_decay must be a number between 0 and 1"]),
    (["--ema_decay", "nan"], ["--ema_decay must be a number between 0 and 1"]),
    (["--ema_decay", "0.9", "--ema_device", "cuda"], ["--ema_device must be cpu"]),
    (["--validation_use_ema"], ["--validation_use_ema", "--ema_decay"]),
]


@pytest.mark.parametrize("flags, fragments", BAD, ids=[" ".join(f) for f, _ in BAD])
def test_bad_input_is_one_line_and_nothing_is_written(job, tmp_path, capsys, flags, fragments):
    out = tmp_path / "out"
    code, _, err = cli(capsys, *argv(job, out, "sft:split")[:-2], *flags)
    one_error_line(code, err, *fragments)
    assert not out.exists()


def test_the_dry_run_plans_the_average(job, tmp_path, capsys):
    base = argv(job, tmp_path / "out", "sft")
    code, out, err = cli(capsys, *base, "--dry_run", "--json")
    assert code == 0, err
    plan = json.loads(out[out.index("{"):])
    train = plan["stages"]["train"]
    assert train["ema_bytes"] == 4 * train["models"]["dit"]["trainable_params"] and not train["ema_on_host"]
    code, out, err = cli(capsys, *base, "--dry_run", "--ema_device", "cpu")
    assert code == 0, err
    assert any(line.split()[:3] == ["ema", "(host,", "fp32)"] for line in out.splitlines())
    assert not (tmp_path / "out").exists()


def test_zero3_keeps_no_average(job, tmp_path, capsys):
    """ZeRO-3 empties the trained weights between forwards: one line. ZeRO-2 keeps them whole after its step, FSDP2
    averages its shards: both planned (their runs are tests/test_engines.py's)."""
    configs = {"FSDP2": "distributed_type: FSDP\nfsdp_config:\n  fsdp_version: 2\n",
               "DeepSpeed ZeRO-3": "distributed_type: DEEPSPEED\ndeepspeed_config:\n  zero_stage: 3\n",
               "DeepSpeed ZeRO-2": "distributed_type: DEEPSPEED\ndeepspeed_config:\n  zero_stage: 2\n"}
    for name, text in configs.items():
        config = tmp_path / "engine.yaml"
        config.write_text(text + "mixed_precision: 'no'\nnum_machines: 1\nnum_processes: 2\n")
        code, _, err = cli(capsys, *argv(job, tmp_path / "out", "sft:split"), "--dry_run", "--config_file",
                           str(config))
        if name.endswith("ZeRO-3"):
            one_error_line(code, err, f"--ema_decay with {name}", "FSDP2, ZeRO-1/2 or data parallel")
        else:
            assert code == 0, err
