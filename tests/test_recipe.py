"""The training recipe beyond DiffSynth's (docs/objective.md): timestep sampling, loss weighting, Min-SNR, caption
dropout, masked loss.

Each is checked against the diffusers function it calls, kept exact when split (split == unsplit at fp32 and bf16
on a flow-matching family, Qwen-Image, and a DDPM one, Stable Diffusion 1.5), kept by `--resume` after a kill, and
refused in one line where it cannot apply.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("diffusers")

from safetensors.torch import load_file  # noqa: E402

from clitools import cli, one_error_line  # noqa: E402
from unitgraph.backends.diffusion.caption_dropout import dropped, with_caption_dropout  # noqa: E402
from unitgraph.backends.diffusion.context import UnitContext, UnitSettings  # noqa: E402
from unitgraph.backends.diffusion.errors import BackendError  # noqa: E402
from unitgraph.backends.diffusion.data.dataset import add_synthetic_masks, write_synthetic_dataset  # noqa: E402
from unitgraph.backends.diffusion.ddpm import DdpmSchedule, min_snr_weight, sample_ddpm_timestep  # noqa: E402
from unitgraph.backends.diffusion.flowmatch import (TimestepSampling, TrainingSchedule,  # noqa: E402
                                                    sample_training_timestep)
from unitgraph.backends.diffusion.train.loop import read_loss_csv  # noqa: E402

SIZE = 32


@pytest.fixture(scope="module")
def sd15(tmp_path_factory) -> Path:
    from unitgraph.backends.diffusion.families.sd15.tiny import write_tiny_models

    return write_tiny_models(tmp_path_factory.mktemp("sd15") / "models", size="test", seed=0)


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("recipe-data")
    write_synthetic_dataset(folder, count=3, size=SIZE, seed=2)
    return folder


@pytest.fixture(scope="module")
def masked(data, tmp_path_factory) -> Path:
    import shutil

    folder = tmp_path_factory.mktemp("recipe-masked") / "data"
    shutil.copytree(data, folder)
    add_synthetic_masks(folder)
    return folder


def argv(models: Path, data: Path, out: Path, task: str, *extra: str, pipeline: str = "qwen_image",
         dit: str = "dit") -> list[str]:
    return ["train", "--task", task, "--pipeline", pipeline, "--model_paths", str(models), "--dataset_base_path",
            str(data), "--dataset_metadata_path", str(data / "metadata.csv"), "--lora_base_model", dit,
            "--lora_rank", "4", "--max_pixels", str(SIZE * SIZE), "--learning_rate", "1e-3", "--seed", "3",
            "--output_path", str(out), "--no-progress", "--no-plot", *extra]


def context(sample: str, **settings) -> UnitContext:
    return UnitContext(models={}, settings=UnitSettings(seed=11, **settings), epoch=0, sample_key=sample)


# -- each feature against the diffusers function it uses ---------------------------------------------------------

@pytest.mark.parametrize("scheme", ["uniform", "logit_normal", "mode"])
def test_a_position_is_diffusers_density_drawn_from_the_samples_timestep_stream(scheme):
    from diffusers.training_utils import compute_density_for_timestep_sampling

    schedule = TrainingSchedule(shift=3.0)
    sampling = TimestepSampling(scheme, logit_mean=0.3, logit_std=0.8, mode_scale=1.0)
    for sample in ("a", "b", "c"):
        ctx = context(sample, timestep_sampling=sampling, loss_weighting="none")
        u = compute_density_for_timestep_sampling(scheme, 1, logit_mean=0.3, logit_std=0.8, mode_scale=1.0,
                                                  generator=ctx.rng("timestep"))
        drawn = sample_training_timestep(ctx, schedule)
        assert drawn["loss_weight"] is None
        assert float(drawn["timestep"][0]) == float(schedule.sigmas()[int(float(u[0]) * 1000)] * 1000.0)


def test_logit_normal_concentrates_the_draws_where_diffusers_density_does():
    """Over many samples the drawn positions follow the density: logit_normal(0, 1) puts about 17% of its mass in
    the outer fifths of [0, 1] (2 x P(N(0,1) > logit(0.8) = 1.386)), the uniform draw 40%."""
    schedule = TrainingSchedule(shift=1.0, open_end=False)
    outer = {}
    for scheme in ("diffsynth", "logit_normal"):
        positions = []
        for i in range(2000):
            ctx = context(str(i), timestep_sampling=TimestepSampling(scheme), loss_weighting="none")
            sigma = float(sample_training_timestep(ctx, schedule)["timestep"][0]) / 1000.0
            positions.append(1.0 - sigma)
        outer[scheme] = sum(p < 0.2 or p > 0.8 for p in positions) / len(positions)
    assert abs(outer["diffsynth"] - 0.40) < 0.04 and abs(outer["logit_normal"] - 0.166) < 0.04, outer


@pytest.mark.parametrize("scheme", ["sigma_sqrt", "cosmap"])
def test_a_weighting_scheme_is_diffusers_sd3_weight_at_the_drawn_sigma(scheme):
    from diffusers.training_utils import compute_loss_weighting_for_sd3

    schedule = TrainingSchedule(mu=0.8, terminal=0.02)
    for sample in ("a", "b"):
        drawn = sample_training_timestep(context(sample, loss_weighting=scheme), schedule)
        sigma = drawn["timestep"] / 1000.0
        assert torch.allclose(drawn["loss_weight"], compute_loss_weighting_for_sd3(scheme, sigma).float(), rtol=1e-6)


@pytest.mark.parametrize("prediction", ["epsilon", "v_prediction"])
def test_min_snr_is_diffusers_text_to_image_weight_on_a_diffusers_scheduler(prediction):
    """The weight, as diffusers' train_text_to_image example computes it from its own DDPMScheduler."""
    from diffusers import DDPMScheduler
    from diffusers.training_utils import compute_snr

    scheduler = DDPMScheduler(beta_schedule="scaled_linear", beta_start=0.00085, beta_end=0.012,
                              prediction_type=prediction)
    timesteps = torch.tensor([0, 10, 250, 500, 999])
    snr = compute_snr(scheduler, timesteps)
    expected = torch.stack([snr, 5.0 * torch.ones_like(timesteps)], dim=1).min(dim=1)[0]
    expected = expected / (snr + 1 if prediction == "v_prediction" else snr)
    schedule = DdpmSchedule(prediction_type=prediction)
    assert torch.allclose(schedule.alphas_cumprod(), scheduler.alphas_cumprod, rtol=1e-6)
    assert torch.allclose(min_snr_weight(schedule.alphas_cumprod(), timesteps, 5.0, prediction), expected.float(),
                          rtol=1e-5)
    # a zero-terminal-SNR schedule's last timestep weighs 1, not 0/0
    zero = DdpmSchedule(rescale_zero_terminal_snr=True, prediction_type=prediction).alphas_cumprod()
    assert float(min_snr_weight(zero, torch.tensor([999]), 5.0, prediction)[0]) == 1.0


def test_a_ddpm_timestep_carries_its_min_snr_weight():
    schedule = DdpmSchedule()
    ctx = context("a", snr_gamma=5.0)
    ctx.memo[("ddpm-schedule",)] = schedule
    drawn = sample_ddpm_timestep(ctx)
    assert torch.equal(drawn["loss_weight"], min_snr_weight(schedule.alphas_cumprod(), drawn["timestep"], 5.0, "epsilon"))
    plain = context("a")
    plain.memo[("ddpm-schedule",)] = schedule
    assert sample_ddpm_timestep(plain)["loss_weight"] is None  # DiffSynth's weight 1


# -- exact when split, and kept by --resume ---------------------------------------------------------------------

@pytest.mark.slow
def test_sigkill_and_resume_keeps_the_recipe(tiny, masked, tmp_path, capsys):
    from test_resume import ENV, command, killed_and_resumed  # noqa: F401  (the kill loop of tests/test_resume.py)

    extra = ("--timestep_sampling", "logit_normal", "--weighting_scheme", "sigma_sqrt", "--num_epochs", "2",
             "--save_steps", "1", "--caption_dropout", "0.5", "--masked_loss", "--masked_loss_unmasked_weight", "0.2",
             "--lora_type", "dora", "--use_rslora", "--ema_decay", "0.9", "--optimizer", "schedulefree")
    whole = tmp_path / "whole"
    code, _, err = cli(capsys, *argv(tiny, masked, whole, "sft:split", *extra))
    assert code == 0, err
    resumed = tmp_path / "resumed"
    kills, printed = killed_and_resumed(command(1) + argv(tiny, masked, resumed, "sft:split", *extra), resumed, kills=1,
                                        rng=random.Random(5))
    assert kills == 1 and "resuming from" in printed, printed
    ra, rb = read_loss_csv(whole / "loss.csv"), read_loss_csv(resumed / "loss.csv")
    assert [(r["step"], r["timestep"]) for r in ra] == [(r["step"], r["timestep"]) for r in rb]
    assert [r["loss"] for r in ra] == pytest.approx([r["loss"] for r in rb], abs=1e-6, rel=0)
    for name in ("epoch-1.safetensors", "epoch-1-ema.safetensors"):  # the weights and their moving average
        wa, wb = load_file(str(whole / name)), load_file(str(resumed / name))
        assert wa.keys() == wb.keys() and all(torch.allclose(wa[k], wb[k], atol=1e-6, rtol=0) for k in wa), name
    # a resume that would draw otherwise is refused, naming the flag
    code, _, err = cli(capsys, *argv(tiny, masked, resumed, "sft:split", *extra[:3], "cosmap", *extra[4:], "--resume"))
    one_error_line(code, err, "--weighting_scheme")


# -- bad input: one line, nothing written ------------------------------------------------------------------------

BAD = [
    (("--masked_loss_unmasked_weight", "0.5"), "qwen_image", "--masked_loss_unmasked_weight has no effect without"),
    (("--masked_loss", "--masked_loss_unmasked_weight", "2"), "qwen_image",
     "--masked_loss_unmasked_weight must be between 0 and 1"),
    (("--caption_dropout", "1.5"), "qwen_image", "--caption_dropout must be a probability between 0 and 1"),
    (("--caption_dropout", "nan"), "qwen_image", "--caption_dropout must be a probability between 0 and 1"),
    (("--timestep_sampling", "sigmoid"), "qwen_image", "--timestep_sampling must be one of"),
    (("--timestep_sampling", "logit_normal", "--logit_std", "0"), "qwen_image", "--logit_std must be above 0"),
    (("--logit_mean", "nan"), "qwen_image", "--logit_mean must be a finite number"),
    (("--weighting_scheme", "snr"), "qwen_image", "--weighting_scheme must be one of"),
    (("--weighting_scheme", "cosmap", "--loss_weighting", "none"), "qwen_image", "disagree"),
    (("--snr_gamma", "5"), "qwen_image", "--snr_gamma: pipeline qwen_image does not train with a DDPM objective"),
    (("--snr_gamma", "-1"), "sd15", "--snr_gamma must be a number above 0"),
    (("--weighting_scheme", "sigma_sqrt"), "sd15", "(a DDPM family: use --snr_gamma)"),
]


@pytest.mark.parametrize("flags, family, fragment", BAD, ids=[" ".join(b[0]) for b in BAD])
def test_a_recipe_flag_that_cannot_apply_is_one_line_and_nothing_is_written(flags, family, fragment, tiny, sd15, data,
                                                                            tmp_path, capsys):
    models, dit = (tiny, "dit") if family == "qwen_image" else (sd15, "unet")
    for dry in ((), ("--dry_run",)):
        code, _, err = cli(capsys, *argv(models, data, tmp_path / "out", "sft", *flags, *dry, pipeline=family, dit=dit))
        one_error_line(code, err, fragment)
        assert not (tmp_path / "out").exists()


def test_the_defaults_leave_existing_states_and_keys_as_they_were():
    """DiffSynth's objective is the default, and records nothing new: states and cache keys made before these
    flags existed still match."""
    assert set(UnitSettings().key_values()) == {"image_size", "dtype", "seed", "timestep_bounds", "loss_weighting"}
    assert UnitSettings(timestep_sampling=TimestepSampling()).key_values() == UnitSettings().key_values()
    recorded = UnitSettings(timestep_sampling=TimestepSampling("mode", logit_mean=3.0), snr_gamma=5.0).key_values()
    assert recorded["timestep_sampling"] == {"scheme": "mode", "mode_scale": 1.29} and recorded["snr_gamma"] == 5.0


# -- caption dropout ---------------------------------------------------------------------------------------------

def test_a_caption_is_dropped_with_its_probability_from_the_samples_stream():
    for p in (0.0, 0.3, 1.0):
        drops = [dropped(context(str(i), caption_dropout=p)) for i in range(2000)]
        assert abs(sum(drops) / len(drops) - p) < 0.03, p
    same = [dropped(context(str(i), caption_dropout=0.5)) for i in range(50)]
    assert same == [dropped(context(str(i), caption_dropout=0.5)) for i in range(50)]  # the sample's own stream


def test_caption_dropout_follows_frozen_prompt_units_and_precedes_trained_ones():
    from unitgraph.backends.diffusion.families.qwen_image import FAMILY

    pipeline = FAMILY.pipelines[0]
    frozen = [u.name for u in with_caption_dropout(pipeline, 0.5, ["dit"]).units]
    assert frozen.index("CaptionDropout") == frozen.index("PromptEncoder") + 1
    live = [u.name for u in with_caption_dropout(pipeline, 0.5, ["text_encoder"]).units]
    assert live.index("PromptDropout") == live.index("PromptEncoder") - 1
    assert with_caption_dropout(pipeline, 0.0, ["dit"]) is pipeline
    edit = next(p for p in FAMILY.pipelines if any("prompt" in u.inputs and len(u.inputs) > 1 for u in p.units))
    with pytest.raises(BackendError) as exc:
        with_caption_dropout(edit, 0.5, ["dit"])
    assert "encodes the prompt together with" in str(exc.value) and "\n" not in str(exc.value)


# the recipe's conformance case: every feature on at once, split == unsplit, on a flow-matching and a DDPM family
RECIPE = {"qwen_image": ("--timestep_sampling", "logit_normal", "--logit_mean", "0.5", "--weighting_scheme", "cosmap"),
          "sd15": ("--timestep_sampling", "mode", "--snr_gamma", "5")}
EVERY = ("--caption_dropout", "0.5", "--masked_loss", "--masked_loss_unmasked_weight", "0.2", "--lora_type", "dora",
         "--use_rslora", "--lora_alpha", "8", "--ema_decay", "0.9", "--num_epochs", "2")
# each case trains with another of the libraries' optimizers (tests/test_optimizers.py has each one's own cases)
OPTIMIZER = {("qwen_image", "no"): "adafactor", ("qwen_image", "bf16"): "prodigy", ("sd15", "no"): "came",
             ("sd15", "bf16"): "schedulefree"}


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["no", "bf16"])
@pytest.mark.parametrize("family", ["qwen_image", "sd15"])
def test_the_recipe_is_exact_when_split_and_stage2_loads_no_text_encoder(family, precision, tiny, sd15, masked,
                                                                         tmp_path, capsys):
    """Timestep sampling and weighting (Min-SNR for SD), caption dropout, masked loss, DoRA with rsLoRA, an EMA and
    one of the libraries' optimizers, all at once: the unsplit run, and stage 1 then stage 2 with the text encoder's
    and tokenizer's folders deleted, train the same losses, weights and moving average."""
    import shutil

    models, dit = (tiny, "dit") if family == "qwen_image" else (sd15, "unet")
    extra = (*RECIPE[family], *EVERY, "--optimizer", OPTIMIZER[family, precision], "--mixed_precision", precision)
    run = lambda *a: cli(capsys, *argv(*a, pipeline=family, dit=dit))  # noqa: E731
    code, _, err = run(models, masked, tmp_path / "unsplit", "sft", *extra)
    assert code == 0, err
    code, _, err = run(models, masked, tmp_path / "plain", "sft", "--num_epochs", "2", "--mixed_precision", precision)
    assert code == 0, err
    copy = tmp_path / "models"
    shutil.copytree(models, copy)
    code, out, err = run(copy, masked, tmp_path / "cache", "sft:data_process", *extra)
    assert code == 0 and "encoded the empty prompt for caption dropout" in out, err
    assert (tmp_path / "cache" / "empty_prompt.safetensors").is_file()
    for folder in ("text_encoder", "tokenizer"):
        shutil.rmtree(copy / folder)
    stage2 = argv(copy, tmp_path / "cache", tmp_path / "split", "sft:train", *extra, pipeline=family, dit=dit)
    stage2.remove("--dataset_metadata_path")
    stage2.remove(str(tmp_path / "cache" / "metadata.csv"))
    code, _, err = cli(capsys, *stage2)
    assert code == 0, err
    la, lb = read_loss_csv(tmp_path / "unsplit" / "loss.csv"), read_loss_csv(tmp_path / "split" / "loss.csv")
    assert [r["timestep"] for r in la] == [r["timestep"] for r in lb] and len(la) == 6
    assert [r["loss"] for r in la] == pytest.approx([r["loss"] for r in lb], abs=1e-6, rel=0)
    wa, wb = load_file(str(tmp_path / "unsplit" / "epoch-1.safetensors")), load_file(str(tmp_path / "split" / "epoch-1.safetensors"))
    assert set(wa) == set(wb) and any(k.endswith(".lora_magnitude_vector") for k in wa)  # the DoRA's magnitudes
    assert all(torch.allclose(wa[k], wb[k], atol=1e-6, rtol=0) for k in wa)
    ea, eb = (load_file(str(tmp_path / n / "epoch-1-ema.safetensors")) for n in ("unsplit", "split"))
    assert set(ea) == set(wa) and all(torch.allclose(ea[k], eb[k], atol=1e-6, rtol=0) for k in ea)
    plain = read_loss_csv(tmp_path / "plain" / "loss.csv")  # the recipe's own draws of the timesteps
    assert [r["timestep"] for r in plain] != [r["timestep"] for r in la]
    # the cache's empty prompt is checked by `cache verify`: a flipped byte is named
    empty = tmp_path / "cache" / "empty_prompt.safetensors"
    body = bytearray(empty.read_bytes())
    body[-1] ^= 0xFF
    empty.write_bytes(bytes(body))
    code, out, err = cli(capsys, "cache", "verify", str(tmp_path / "cache"))
    assert code != 0 and "encoded empty prompt" in out + err and "checksum" in out + err


@pytest.mark.slow
def test_dropped_captions_and_the_masks_weights_change_the_loss_of_the_same_draws(tiny, masked, tmp_path, capsys):
    """On the same samples, timesteps and noise: a mask's weights take loss away from every sample but the all-white
    one (W = 0 against W = 1, the plain loss), and dropped captions change it (all dropped against none)."""
    runs = {"masked": ("--masked_loss",), "one": ("--masked_loss", "--masked_loss_unmasked_weight", "1"),
            "dropped": ("--masked_loss", "--caption_dropout", "1")}
    for name, extra in runs.items():
        code, _, err = cli(capsys, *argv(tiny, masked, tmp_path / name, "sft", "--mixed_precision", "no", *extra))
        assert code == 0, err
    rows = {name: read_loss_csv(tmp_path / name / "loss.csv") for name in runs}
    assert [r["timestep"] for r in rows["one"]] == [r["timestep"] for r in rows["masked"]] \
        == [r["timestep"] for r in rows["dropped"]]
    masked_losses, plain = [r["loss"] for r in rows["masked"]], [r["loss"] for r in rows["one"]]
    assert sum(m < p * 0.99 for m, p in zip(masked_losses, plain)) == 2, (masked_losses, plain)
    # the all-white sample's loss is the plain one (up to the other steps' updates of the weights before it)
    assert sum(m == pytest.approx(p, rel=1e-3) for m, p in zip(masked_losses, plain)) == 1, (masked_losses, plain)
    assert rows["dropped"][0]["loss"] != pytest.approx(rows["masked"][0]["loss"], rel=1e-6)


@pytest.mark.slow
def test_with_a_text_encoder_lora_the_empty_prompt_is_encoded_live(tiny, data, tmp_path, capsys):
    extra = ("--caption_dropout", "0.5", "--num_epochs", "2")
    for task, name in (("sft", "unsplit"), ("sft:split", "split")):
        code, _, err = cli(capsys, *argv(tiny, data, tmp_path / name, task, *extra, dit="text_encoder"))
        assert code == 0, err
    la, lb = read_loss_csv(tmp_path / "unsplit" / "loss.csv"), read_loss_csv(tmp_path / "split" / "loss.csv")
    assert [r["loss"] for r in la] == pytest.approx([r["loss"] for r in lb], abs=1e-6, rel=0)
    assert not (tmp_path / "split" / "cache" / "empty_prompt.safetensors").exists()  # nothing encoded ahead


def test_a_cache_made_without_caption_dropout_says_so(tiny, data, tmp_path, capsys):
    code, _, err = cli(capsys, *argv(tiny, data, tmp_path / "cache", "sft:data_process"))
    assert code == 0, err
    stage2 = argv(tiny, tmp_path / "cache", tmp_path / "out", "sft:train", "--caption_dropout", "0.2")
    code, _, err = cli(capsys, *stage2[:stage2.index("--dataset_metadata_path")], *stage2[stage2.index("--dataset_metadata_path") + 2:])
    one_error_line(code, err, "units only this run has: CaptionDropout", "--caption_dropout")
    assert not (tmp_path / "out").exists()


# -- masked loss -------------------------------------------------------------------------------------------------

def test_the_loss_mask_is_the_masks_coverage_of_each_latent_cell_after_the_images_crop():
    """A 64x32 image covers a 32x32 target by a centre crop: the mask is cropped the same way, then averaged over
    the 8x8 pixels of each latent cell."""
    from PIL import Image

    from unitgraph.backends.diffusion.data.masks import loss_mask_unit

    mask = Image.new("L", (64, 32), 0)
    mask.paste(255, (16, 0, 32, 32))  # the crop keeps x 16..48: its left half is white
    pixels = torch.zeros(1, 3, 1, 32, 32)
    out = loss_mask_unit(context("a"), {"mask": mask.convert("RGB"), "image": pixels,
                                        "latent_mean": torch.zeros(1, 16, 1, 4, 4)})["loss_mask"]
    assert out.shape == (1, 1, 4, 4)
    assert out[0, 0].tolist() == [[1.0, 1.0, 0.0, 0.0]] * 4


def test_masked_weights_follow_each_latent_layout():
    from unitgraph.backends.diffusion.masked_loss import mask_like

    weights = torch.rand(2, 1, 4, 6)
    grid = mask_like(weights, torch.zeros(2, 16, 4, 6))
    assert torch.equal(grid.expand(2, 16, 4, 6)[:, 3], weights[:, 0])
    frames = mask_like(weights, torch.zeros(2, 16, 1, 4, 6))
    assert frames.shape == (2, 1, 1, 4, 6)
    tokens = mask_like(weights, torch.zeros(2, 24, 128))  # FLUX.2: one token per latent cell
    assert torch.equal(tokens[:, :, 0], weights.flatten(1))
    # FLUX.1 / Qwen-Image: packing a per-channel copy of the weights as the family packs its latents gives them
    from unitgraph.backends.diffusion.families.qwen_image.units import pack

    packed = mask_like(weights, torch.zeros(2, 6, 64))
    assert torch.equal(packed, pack(weights.expand(2, 16, 4, 6).reshape(2, 16, 1, 4, 6)))
    with pytest.raises(BackendError):
        mask_like(weights, torch.zeros(2, 5, 7))


def test_an_all_white_mask_or_an_unmasked_weight_of_one_is_the_plain_loss():
    from unitgraph.backends.diffusion.flowmatch import flow_matching_mse
    from unitgraph.backends.diffusion.masked_loss import masked, weights_of

    pred, target = torch.randn(2, 6, 64), torch.randn(2, 6, 64)
    plain = flow_matching_mse(pred, target, torch.tensor([0.5, 2.0]))
    half = torch.zeros(2, 1, 4, 6)
    half[..., :3] = 1.0
    for mask, unmasked in ((torch.ones(2, 1, 4, 6), 0.0), (half, 1.0)):
        with masked(weights_of(mask, unmasked)):
            assert torch.allclose(flow_matching_mse(pred, target, torch.tensor([0.5, 2.0])), plain, rtol=1e-6)
    with masked(weights_of(half, 0.0)):  # the left half's squared errors only, over every position
        masked = flow_matching_mse(pred, target)
    cells = mask_cells = half.reshape(2, 1, 2, 2, 3, 2).permute(0, 2, 4, 1, 3, 5).reshape(2, 6, 4).repeat(1, 1, 16)
    assert torch.allclose(masked, ((pred - target) ** 2 * cells).mean(), rtol=1e-6) and mask_cells is cells


def test_a_mask_of_another_size_or_missing_is_one_line_and_nothing_is_written(tiny, data, tmp_path, capsys):
    import shutil

    code, _, err = cli(capsys, *argv(tiny, data, tmp_path / "none", "sft", "--masked_loss"))
    one_error_line(code, err, "missing column 'mask'")
    assert not (tmp_path / "none").exists()

    for case in ("size", "missing", "unreadable"):
        folder = tmp_path / case / "data"
        shutil.copytree(data, folder)
        add_synthetic_masks(folder, size=(SIZE + 8, SIZE) if case == "size" else None)
        if case == "missing":
            (folder / "mask-1.png").unlink()
        if case == "unreadable":
            (folder / "mask-1.png").write_bytes(b"not a png")
        for task in ("sft", "sft:split"):
            code, _, err = cli(capsys, *argv(tiny, folder, tmp_path / case / "out", task, "--masked_loss"))
            fragment = {"size": "must be the same size", "missing": "missing file 'mask-1.png'",
                        "unreadable": "'mask-1.png' (column 'mask') is not a readable image"}[case]
            one_error_line(code, err, fragment, "row ")
            assert not (tmp_path / case / "out").exists()


def test_masked_loss_is_refused_where_no_mask_fits():
    from unitgraph.backends.diffusion.families.wan import FAMILY as WAN
    from unitgraph.backends.diffusion.families.qwen_image import FAMILY as QWEN
    from unitgraph.backends.diffusion.data.masks import with_masked_loss

    for pipeline, fragment in ((WAN.pipelines[0], "a video pipeline"),
                               (next(p for p in QWEN.pipelines if p.task == "direct_distill"), "not an MSE")):
        with pytest.raises(BackendError) as exc:
            with_masked_loss(pipeline, True)
        assert fragment in str(exc.value) and "--masked_loss" in str(exc.value)
    pipeline = with_masked_loss(QWEN.pipelines[0], True)
    assert "mask" in pipeline.required and "loss_mask" in pipeline.loss.declaration.inputs
    names = [u.name for u in pipeline.units]
    assert names.index("LossMask") == names.index("ImageEncoder") + 1


def test_the_dry_run_plans_a_masked_run(tiny, masked, capsys):
    code, out, err = cli(capsys, *argv(tiny, masked, masked / "never", "sft:split", "--masked_loss", "--dry_run"))
    assert code == 0, err
    assert not (masked / "never").exists()


def test_damaged_mask_files_are_read_or_one_line(tmp_path_factory, data):
    """Property: a mask file of damaged bytes, any size or mode, is read or stops the run with one BackendError
    naming the row (never another exception, never a skipped sample)."""
    import io
    import os
    import shutil

    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st
    from PIL import Image

    from unitgraph.backends.diffusion.data.dataset import DiffusionDataset

    folder = tmp_path_factory.mktemp("mask-fuzz") / "data"
    shutil.copytree(data, folder)
    add_synthetic_masks(folder)

    @settings(max_examples=int(os.environ.get("UNITGRAPH_FUZZ_EXAMPLES", "40")), deadline=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
    @given(size=st.tuples(st.integers(1, 48), st.integers(1, 48)), mode=st.sampled_from(["L", "RGB", "RGBA", "1", "I;16"]),
           cuts=st.lists(st.tuples(st.integers(0, 400), st.integers(0, 255)), max_size=4), keep=st.integers(0, 600))
    def check(size, mode, cuts, keep):
        buffer = io.BytesIO()
        Image.new(mode, size).save(buffer, format="PNG")
        raw = bytearray(buffer.getvalue())
        for at, value in cuts:
            if at < len(raw):
                raw[at] = value
        (folder / "mask-0.png").write_bytes(bytes(raw[:keep]) if keep < len(raw) else bytes(raw))
        dataset = DiffusionDataset(folder, folder / "metadata.csv", ["image", "prompt", "mask"],
                                   required=("image", "prompt", "mask"), image_params=("image", "mask"),
                                   strict=("mask",))
        try:
            dataset.check(0)
            dataset.sample(0)
        except BackendError as exc:
            line = exc.one_line()
            assert "\n" not in line and "row 1" in line and "mask" in line, line

    check()


def test_cache_repair_remakes_a_recipe_cache_as_it_was_made(tiny, masked, tmp_path, capsys):
    """`cache repair` re-runs stage 1 with the flags that shaped the cache's plan (--caption_dropout, --masked_loss,
    --vae_latents: recorded in the manifest's made_with), so it recomputes a lost entry and the empty prompt."""
    cache = tmp_path / "cache"
    flags = ("--caption_dropout", "0.2", "--masked_loss", "--vae_latents", "sample")
    code, _, err = cli(capsys, *argv(tiny, masked, cache, "sft:data_process", *flags))
    assert code == 0, err
    (cache / "empty_prompt.safetensors").unlink()
    next((cache / "entries").iterdir()).unlink()
    code, out, err = cli(capsys, "cache", "repair", str(cache))
    assert code == 0 and "recomputed 1 entry" in out + err and "encoded the empty prompt" in out + err, err
    assert (cache / "empty_prompt.safetensors").is_file()
    code, out, err = cli(capsys, "cache", "verify", str(cache))
    assert code == 0, out + err
