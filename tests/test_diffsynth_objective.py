"""The objective a flow-matching step trains, checked against DiffSynth-Studio's own code.

DiffSynth's scheduler (diffsynth/diffusion/flow_match.py) and its loss (diffsynth/diffusion/loss.py) are
read by path from the wheel the setup unpacks beside the venv (`diffsynth` itself is not importable: its
dependencies are not installed). Each family's training schedule and weight must be DiffSynth's template
for it, and each family's loss, given the timestep and noise DiffSynth's loss draws, must be the value
DiffSynth's FlowMatchSFTLoss computes around the same denoiser. Then the learning-rate schedules, and what
a run records of them: loss.csv's timestep column.
"""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from diffsynth_wheel import wheel_modules  # noqa: E402
from unitgraph.backends.diffusion.context import UnitContext, UnitSettings  # noqa: E402
from unitgraph.backends.diffusion.families.flux import losses as flux_losses, units as flux_units  # noqa: E402
from unitgraph.backends.diffusion.families.qwen_image import losses as qwen_losses, units as qwen_units  # noqa: E402
from unitgraph.backends.diffusion.families.wan import losses as wan_losses, units as wan_units  # noqa: E402
from unitgraph.backends.diffusion.flowmatch import TrainingSchedule, flow_matching_mse  # noqa: E402
from unitgraph.backends.diffusion.train import lr  # noqa: E402

WHEEL = Path(__file__).resolve().parents[1] / ".venv" / "diffsynth-wheel" / "diffsynth" / "diffusion"
needs_wheel = pytest.mark.skipif(not (WHEEL / "flow_match.py").is_file(), reason="the diffsynth wheel is not unpacked")

# family -> (DiffSynth's template name, our schedule, the family's losses module)
FAMILIES = {
    "qwen_image": ("Qwen-Image", qwen_units.TRAINING_SCHEDULE, qwen_losses),
    "flux": ("FLUX.1", flux_units.TRAINING_SCHEDULE, flux_losses),
    "wan": ("Wan", wan_units.TRAINING_SCHEDULE, wan_losses),
}



@pytest.fixture(scope="module")
def diffsynth():
    """DiffSynth's flow_match and loss modules, loaded from the wheel's files (loss.py's one package import, the
    pipeline base class it names in an annotation, stood in for)."""
    with wheel_modules("_diffsynth_diffusion", "flow_match", "loss") as modules:
        yield modules


def _theirs(flow_match, template: str):
    scheduler = flow_match.FlowMatchScheduler(template)
    scheduler.set_timesteps(1000, training=True)  # as DiffSynth's training module sets it up
    return scheduler


@needs_wheel
@pytest.mark.parametrize("family", FAMILIES)
def test_training_schedule_and_weight_are_diffsynths_template(diffsynth, family):
    template, schedule, _ = FAMILIES[family]
    theirs = _theirs(diffsynth[0], template)
    assert torch.allclose(schedule.sigmas(), theirs.sigmas.float(), atol=1e-6, rtol=0)
    assert torch.allclose(schedule.weights(), theirs.linear_timesteps_weights.float(), atol=1e-5, rtol=1e-5)
    weights = schedule.weights()
    assert abs(float(weights.mean()) - 1.0) < 1e-5 and float(weights.min()) >= 0.0
    # index by index, DiffSynth's training_weight(timestep) is our weight at the drawn position
    for index in (0, 1, 137, 500, 998, 999):
        timestep = theirs.timesteps[index:index + 1]
        assert float(theirs.training_weight(timestep)) == pytest.approx(float(weights[index]), rel=1e-5, abs=1e-6)


def test_the_templates_differ_where_diffsynth_says():
    """Qwen-Image's mu is fixed (0.8, every image size), FLUX.1's shift static 3 ending at 0.003/1.002, Wan's shift 5."""
    qwen, flux, wan = (FAMILIES[f][1] for f in ("qwen_image", "flux", "wan"))
    assert float(qwen.sigmas()[-1]) == pytest.approx(0.02, abs=1e-6)  # the terminal stretch
    assert float(flux.sigmas()[-1]) == pytest.approx(3 * (0.003 / 1.002) / (1 + 2 * 0.003 / 1.002), rel=1e-5)
    assert float(wan.sigmas()[0]) == 1.0 and float(wan.sigmas()[-1]) == pytest.approx(5e-3 / (1 + 4e-3), rel=1e-4)
    # the weight peaks where sigma crosses 0.5 and is 0 at sigma 1
    for schedule in (qwen, flux, wan):
        w, s = schedule.weights(), schedule.sigmas()
        assert float(w[0]) == 0.0 and abs(float(s[int(w.argmax())]) - 0.5) < 0.01


def _ctx(bounds=(0.0, 1.0), weighting="diffsynth", key="s0") -> UnitContext:
    return UnitContext(models={}, settings=UnitSettings(timestep_bounds=bounds, loss_weighting=weighting, seed=5),
                       epoch=0, sample_key=key)


@pytest.mark.parametrize("family", FAMILIES)
def test_the_timestep_sampler_draws_a_position_and_its_weight(family):
    _, schedule, _ = FAMILIES[family]
    sampler = {"qwen_image": qwen_units, "flux": flux_units, "wan": wan_units}[family].timestep_sampler
    sigmas, weights = schedule.sigmas(), schedule.weights()
    for k in range(20):
        out = sampler(_ctx(key=f"s{k}"), {})
        index = int(torch.argmin((sigmas * 1000 - out["timestep"]).abs()))
        assert float(out["timestep"]) == float(sigmas[index] * 1000) and float(out["loss_weight"]) == float(weights[index])
    assert sampler(_ctx(weighting="none"), {})["loss_weight"] is None
    # --max_timestep_boundary 0.25: the noisiest quarter of the positions only
    high = [float(sampler(_ctx(bounds=(0.0, 0.25), key=f"h{k}"), {})["timestep"]) for k in range(30)]
    assert min(high) >= float(sigmas[249] * 1000) - 1e-3


class _Pipe:
    """What FlowMatchSFTLoss reads of a pipeline: its scheduler, dtype and device, and the denoiser call."""

    in_iteration_models = ()

    def __init__(self, scheduler, model_fn):
        self.scheduler, self.model_fn = scheduler, model_fn
        self.torch_dtype, self.device = torch.float32, "cpu"


def _denoiser(latents: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
    """A fixed stand-in for the DiT: some velocity that depends on the noisy latents and the noise level."""
    g = torch.Generator().manual_seed(11)
    mix = torch.randn(latents.shape[-1], latents.shape[-1], generator=g, dtype=latents.dtype) / latents.shape[-1]
    return torch.tanh(latents @ mix) * (1.0 + sigma.reshape(-1, *([1] * (latents.dim() - 1))))


@needs_wheel
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("weighting", ["diffsynth", "none"])
def test_the_loss_is_diffsynths_flow_match_sft_loss(diffsynth, family, weighting, monkeypatch):
    """DiffSynth's FlowMatchSFTLoss (its draws from torch's global generator) and our sink, given those same draws
    and the same denoiser, give the same loss; with --loss_weighting none, DiffSynth's value without its weight."""
    template, schedule, losses = FAMILIES[family]
    theirs = _theirs(diffsynth[0], template)
    shape = (1, 4, 2, 4, 4) if family == "wan" else (1, 16, 8)
    x0 = torch.randn(*shape, generator=torch.Generator().manual_seed(3))
    seen = {}

    def model_fn(latents, timestep, **_):
        seen["timestep"] = timestep
        return _denoiser(latents, timestep / 1000.0)

    for seed in range(4):
        torch.manual_seed(seed)
        expected = diffsynth[1].FlowMatchSFTLoss(_Pipe(theirs, model_fn), input_latents=x0.clone())
        torch.manual_seed(seed)  # the same draws, in DiffSynth's order: the position, then the noise
        index = int(torch.randint(0, 1000, (1,)))
        noise = torch.randn_like(x0)
        timestep = (schedule.sigmas()[index] * 1000).reshape(1)
        assert float(seen["timestep"]) == pytest.approx(float(timestep), rel=1e-6)
        weight = schedule.weights()[index].reshape(1) if weighting == "diffsynth" else None
        if family == "wan":
            monkeypatch.setattr(losses, "predict", lambda ctx, noisy, t, *a: _denoiser(noisy, t / 1000.0))
            inputs = {"input_latents": x0, "noise": noise, "timestep": timestep, "loss_weight": weight,
                      "prompt_emb": None}
        else:
            monkeypatch.setattr(losses, "predict", lambda ctx, noisy, sigma, *a: _denoiser(noisy, sigma))
            inputs = {"input_latents": x0, "noise": noise, "timestep": timestep, "loss_weight": weight,
                      "prompt_emb": None, "prompt_emb_mask": None, "edit_latents": None, "img_shapes": None,
                      "pooled_prompt_emb": None, "guidance": None, "latent_grid": None}
        ours = losses.flow_matching_loss(_ctx(), inputs)
        if weighting == "none":
            expected = expected / theirs.training_weight(seen["timestep"])
        assert float(ours) == pytest.approx(float(expected), rel=1e-5), (family, seed)


def test_a_batch_weights_each_sample_by_its_own_timestep():
    pred, target = torch.randn(3, 5, 2), torch.randn(3, 5, 2)
    weight = torch.tensor([0.0, 1.0, 2.0])
    per = [torch.nn.functional.mse_loss(pred[i], target[i]) for i in range(3)]
    assert float(flow_matching_mse(pred, target, weight)) == pytest.approx(float(sum(w * p for w, p in zip(weight, per)) / 3))
    assert torch.equal(flow_matching_mse(pred, target), torch.nn.functional.mse_loss(pred, target))
    assert torch.equal(flow_matching_mse(pred[:1], target[:1], weight[2:]), torch.nn.functional.mse_loss(pred[:1], target[:1]) * 2)


def test_training_schedule_docstring_grid():
    """open_end leaves sigma_min out (DiffSynth's Wan/Qwen grids), a closed grid ends on it (FLUX.1's)."""
    assert float(TrainingSchedule(open_end=False, sigma_min=0.25, steps=4).sigmas()[-1]) == 0.25
    assert float(TrainingSchedule(open_end=True, steps=4).sigmas()[-1]) == 0.25


# ------------------------------------------------------------------------------------------------
# learning rate


def _rates(schedule, steps: int) -> list[float]:
    out = []
    for _ in range(steps):
        out.append(schedule.optimizer.param_groups[0]["lr"])
        schedule.optimizer.step()
        lr.step(schedule)
    return out


def _optimizer():
    return torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=1e-3)


@needs_wheel
def test_the_default_schedule_is_diffsynths_runner():
    """DiffSynth's runner wraps AdamW in ConstantLR with torch's defaults: the first 5 steps at lr / 3."""
    runner = (WHEEL / "runner.py").read_text()
    assert "torch.optim.lr_scheduler.ConstantLR(optimizer)" in runner
    theirs = torch.optim.lr_scheduler.ConstantLR(_optimizer())
    ours = lr.make_lr_schedule("diffsynth", _optimizer(), 0, 100)
    assert _rates(ours, 8) == _rates(theirs, 8)
    assert _rates(lr.make_lr_schedule("diffsynth", _optimizer(), 0, 100), 6) == pytest.approx([1e-3 / 3] * 5 + [1e-3])


@pytest.mark.parametrize("name", ["diffsynth", "constant", "constant_with_warmup", "linear", "cosine",
                                  "cosine_with_restarts", "polynomial"])
def test_a_resumed_schedule_continues_with_the_same_rates(name):
    """seek(N) on a fresh schedule gives bitwise the rates the uninterrupted schedule has from step N on."""
    whole = _rates(lr.make_lr_schedule(name, _optimizer(), 3, 20), 20)
    for n in (0, 2, 5, 13):
        resumed = lr.make_lr_schedule(name, _optimizer(), 3, 20)
        lr.seek(resumed, n)
        assert _rates(resumed, 20 - n) == whole[n:], (name, n)
    if name == "cosine":
        assert whole[0] == 0.0 and whole[3] == pytest.approx(1e-3) and whole[-1] < 1e-4


# ------------------------------------------------------------------------------------------------
# a run: the latent mode, the weighting and the schedule, split and unsplit


SIZE = 32


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    from unitgraph.backends.diffusion.data.dataset import write_synthetic_dataset

    folder = tmp_path_factory.mktemp("objective-data")
    write_synthetic_dataset(folder, count=3, size=SIZE, seed=4)
    return folder


def _train(out: Path, task: str, tiny: Path, data: Path, **extra):
    from unitgraph.backends.diffusion.args import make_args
    from unitgraph.backends.diffusion.stages import run

    flags = dict(dataset_base_path=str(data), dataset_metadata_path=str(data / "metadata.csv"), model_paths=str(tiny),
                 lora_base_model="dit", lora_target_modules="to_q,to_k,to_v,to_out.0", lora_rank=4,
                 max_pixels=SIZE * SIZE, seed=3, learning_rate=1e-3, num_epochs=2, progress=False, plot=False)
    return run(make_args(task=task, output_path=str(out), **{**flags, **extra}), echo=lambda _t: None)


def _rows(folder: Path) -> list[dict]:
    from unitgraph.backends.diffusion.train.loop import read_loss_csv

    return read_loss_csv(folder / "loss.csv")


@pytest.mark.slow
@pytest.mark.parametrize("extra", [{}, {"vae_latents": "sample", "loss_weighting": "none", "lr_scheduler": "cosine",
                                        "lr_warmup_steps": 2}], ids=["diffsynth", "sample-none-cosine"])
def test_split_equals_unsplit_and_loss_csv_records_the_timesteps(extra, tiny, data, tmp_path):
    from safetensors.torch import load_file

    from unitgraph.backends.diffusion.cache.cache import Cache

    _train(tmp_path / "unsplit", "sft", tiny, data, **extra)
    split = _train(tmp_path / "split", "sft:split", tiny, data, **extra)
    a, b = _rows(tmp_path / "unsplit"), _rows(tmp_path / "split")
    assert [r["loss"] for r in a] == [r["loss"] for r in b] and len(a) == 6
    assert [r["timestep"] for r in a] == [r["timestep"] for r in b]
    assert all(0.0 < r["timestep"] <= 1000.0 for r in a) and len({r["timestep"] for r in a}) > 1
    wa, wb = load_file(str(tmp_path / "unsplit" / "epoch-1.safetensors")), load_file(str(tmp_path / "split" / "epoch-1.safetensors"))
    assert all(torch.equal(wa[k], wb[k]) for k in wa) and wa
    # what the cache holds: the posterior mean as the latent, or (sample) the posterior to draw from
    cache = Cache(split.cache_path)
    values = cache.load_entry(next(iter(cache.read_manifest().entries.values())), "an entry")
    if extra.get("vae_latents") == "sample":
        assert {"latent_mean", "latent_logvar"} <= set(values) and "input_latents" not in values
    else:
        assert "input_latents" in values and not {"latent_mean", "latent_logvar"} & set(values)


@pytest.mark.slow
def test_the_weighting_and_the_schedule_change_the_training(tiny, data, tmp_path):
    """Same draws (same seed), so the diffsynth weighting's losses are the unweighted ones times each step's weight;
    a cosine schedule with warm-up trains other weights than the default."""
    from safetensors.torch import load_file

    _train(tmp_path / "weighted", "sft", tiny, data, num_epochs=1, learning_rate=1e-9)
    _train(tmp_path / "plain", "sft", tiny, data, num_epochs=1, learning_rate=1e-9, loss_weighting="none")
    weighted, plain = _rows(tmp_path / "weighted"), _rows(tmp_path / "plain")
    assert [r["timestep"] for r in weighted] == [r["timestep"] for r in plain]
    schedule = qwen_units.TRAINING_SCHEDULE
    sigmas, weights = schedule.sigmas(), schedule.weights()
    for w, p in zip(weighted, plain):
        index = int(torch.argmin((sigmas * 1000 - w["timestep"]).abs()))
        assert w["loss"] == pytest.approx(p["loss"] * float(weights[index]), rel=2e-2)
    _train(tmp_path / "cosine", "sft", tiny, data, num_epochs=1, learning_rate=1e-9, lr_scheduler="cosine",
           lr_warmup_steps=1)
    first = load_file(str(tmp_path / "weighted" / "epoch-0.safetensors"))
    other = load_file(str(tmp_path / "cosine" / "epoch-0.safetensors"))
    assert any(not torch.equal(first[k], other[k]) for k in first)


def test_bad_objective_flags_are_one_line(capsys, tiny, data, tmp_path):
    from clitools import cli, one_error_line

    base = ["train", "--task", "sft", "--model_paths", str(tiny), "--dataset_base_path", str(data),
            "--dataset_metadata_path", str(data / "metadata.csv"), "--lora_base_model", "dit",
            "--output_path", str(tmp_path / "out")]
    for flag, value, fragment in (("--vae_latents", "mode", "--vae_latents must be one of mean, sample"),
                                  ("--loss_weighting", "snr", "--weighting_scheme must be one of diffsynth, none"),
                                  ("--lr_scheduler", "step", "--lr_scheduler must be one of diffsynth")):
        code, _, err = cli(capsys, *base, flag, value)
        one_error_line(code, err, fragment)
    code, _, err = cli(capsys, *base, "--lr_warmup_steps", "3")
    one_error_line(code, err, "--lr_warmup_steps needs a schedule with a warm-up")
    assert not (tmp_path / "out").exists()


def test_vae_latents_swaps_the_latent_unit_either_way_and_none_keeps_the_declaration():
    from unitgraph.backends.diffusion.flowmatch import latent_sampler, posterior_mean, with_vae_latents
    from unitgraph.backends.diffusion.registry import families

    swapped = 0
    for family in families():
        for pipeline in family.pipelines:
            assert with_vae_latents(pipeline, None) is pipeline
            units = set(pipeline.units)
            if not units & {posterior_mean, latent_sampler}:  # a distillation: its target is the mean whatever the flag
                assert with_vae_latents(pipeline, "sample") is pipeline
                continue
            mean, sample = with_vae_latents(pipeline, "mean"), with_vae_latents(pipeline, "sample")
            assert posterior_mean in mean.units and latent_sampler not in mean.units
            assert latent_sampler in sample.units and posterior_mean not in sample.units
            assert [u.name for u in mean.units].index("PosteriorMean") == [u.name for u in sample.units].index("LatentSampler")
            swapped += 1
    assert swapped >= 8
