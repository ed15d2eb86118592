"""LoRA variants through peft (docs/objective.md, "LoRA variants"): DoRA (`--lora_type dora`) and rank-stabilised
LoRA (`--use_rslora`), exact when split (with the rest of the recipe: tests/test_recipe.py), written in diffusers' layout (its
`load_lora_weights` rebuilds the same adapter), read back by every reader of LoRA files, and refused in one line
where they cannot apply. LoKr and LoHa (`--lora_type lokr|loha`): exact when split and resumed, on a flow-matching and
a DDPM family, written in LyCORIS' layout, which lycoris-lora's own loader puts on a fresh base model to compute what
the trained model computes; read back by `--lora_checkpoint` and `--preset_lora_path`, refused by `lora convert`.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("peft")

from safetensors.torch import load_file  # noqa: E402

from clitools import cli, one_error_line  # noqa: E402
from test_recipe import argv  # noqa: E402  (the recipe's command line)
from unitgraph.backends.diffusion.data.dataset import write_synthetic_dataset  # noqa: E402
from unitgraph.backends.diffusion.models.lora import add_lora, merge_preset_lora, read_lora_file  # noqa: E402
from unitgraph.backends.diffusion.train.loop import read_loss_csv  # noqa: E402

SIZE = 32
VARIANT = ("--lora_type", "dora", "--use_rslora", "--lora_alpha", "8")


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("variants-data")
    write_synthetic_dataset(folder, count=3, size=SIZE, seed=4)
    return folder


def test_a_dora_preset_merges_to_what_peft_computes():
    """merge_preset_lora of a DoRA file gives the base weight the adapted layer computes: the rows of W + s B A
    rescaled to the magnitudes, s = alpha / sqrt(rank) with rsLoRA."""
    from peft.utils import get_peft_model_state_dict
    from safetensors.torch import save_file

    torch.manual_seed(0)
    trained = torch.nn.Sequential(torch.nn.Linear(8, 6))
    base = trained[0].weight.detach().clone()
    add_lora(trained, "dit", ["0"], 2, 4.0, seed=1, kind="dora", rslora=True)
    with torch.no_grad():
        for name, param in trained.named_parameters():
            if "lora_" in name:
                param.add_(torch.randn_like(param) * 0.3)
    x = torch.randn(5, 8)
    expected = trained(x)
    state = {f"transformer.{k}": v for k, v in get_peft_model_state_dict(trained, adapter_name="default").items()}
    import json
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "dora.safetensors"
        meta = {"transformer.r": 2, "transformer.lora_alpha": 4.0, "transformer.use_rslora": True,
                "transformer.use_dora": True}
        save_file(state, str(path), metadata={"lora_adapter_metadata": json.dumps(meta)})
        lora = read_lora_file(path, "dit", {"dit": "transformer"})
        assert lora.dora and lora.rslora and lora.scales["0"] == pytest.approx(4.0 / math.sqrt(2))
        plain = torch.nn.Sequential(torch.nn.Linear(8, 6))
        with torch.no_grad():
            plain[0].weight.copy_(base)
            plain[0].bias.copy_(trained[0].base_layer.bias)
        assert merge_preset_lora(plain, "dit", path, "transformer") == 1
    assert torch.allclose(plain(x), expected, atol=1e-5)


# split == unsplit with DoRA and rsLoRA, at fp32 and bf16 on Qwen-Image and SD 1.5: the recipe's conformance case
# (tests/test_recipe.py), which turns every feature on at once


@pytest.mark.slow
def test_a_dora_file_loads_in_the_diffusers_pipeline_and_continues_here(tiny, data, tmp_path, capsys):
    import diffusers
    from peft.utils import get_peft_model_state_dict

    code, _, err = cli(capsys, *argv(tiny, data, tmp_path / "out", "sft:split", *VARIANT))
    assert code == 0, err
    ckpt = tmp_path / "out" / "epoch-0.safetensors"
    saved = load_file(str(ckpt))
    pipe = diffusers.QwenImagePipeline.from_pretrained(str(tiny))
    pipe.load_lora_weights(str(ckpt))
    adapter = next(iter(pipe.transformer.peft_config))
    config = pipe.transformer.peft_config[adapter]
    assert config.use_dora and config.use_rslora and config.lora_alpha == 8 and config.r == 4
    loaded = get_peft_model_state_dict(pipe.transformer, adapter_name=adapter)
    assert {f"transformer.{k}" for k in loaded} == set(saved)
    for key, value in loaded.items():
        assert torch.equal(value, saved[f"transformer.{key}"]), key
    # --lora_checkpoint continues from it; a plain LoRA run is told which type it is
    code, _, err = cli(capsys, *argv(tiny, data, tmp_path / "more", "sft", *VARIANT, "--lora_checkpoint", str(ckpt)))
    assert code == 0, err
    code, _, err = cli(capsys, *argv(tiny, data, tmp_path / "plain", "sft", "--lora_checkpoint", str(ckpt)))
    one_error_line(code, err, "the checkpoint is a DoRA", "--lora_type")
    # converted, it stays a DoRA for diffusers; DiffSynth's layout cannot hold it
    code, _, err = cli(capsys, "lora", "convert", str(ckpt), str(tmp_path / "copy.safetensors"), "--to", "diffusers")
    assert code == 0, err
    assert load_file(str(tmp_path / "copy.safetensors")).keys() == saved.keys()
    code, _, err = cli(capsys, "lora", "convert", str(ckpt), str(tmp_path / "ds.safetensors"), "--to", "diffsynth")
    one_error_line(code, err, "is a DoRA")
    assert not (tmp_path / "ds.safetensors").exists()


BAD = [
    (("--lora_type", "vera"), "--lora_type must be one of lora, dora, lokr, loha"),
    (("--lora_type", "dora", "--lora_format", "diffsynth"), "DiffSynth-Studio's LoRA layout has no DoRA magnitudes"),
    (("--lora_type", "dora", "--fp8_models", "dit"), "--lora_type dora with --fp8_models dit"),
    (("--lora_type", "dora", "--lora_target_modules", "img_norm1"), "peft cannot add a LoRA adapter to dit"),  # a LayerNorm
    (("--lora_type", "lokr", "--lora_format", "diffsynth"), "load_lora fuses lora_A/lora_B pairs only"),
    (("--lora_type", "loha", "--use_rslora"), "--use_rslora with --lora_type loha"),
    (("--lora_type", "lokr", "--fp8_models", "dit"), "--lora_type lokr with --fp8_models dit"),
    (("--lora_type", "loha", "--lora_target_modules", "img_norm1"), "peft cannot add a LoHa adapter to dit"),
    (("--lora_type", "lokr", "--lora_target_modules", "nothing_here"), "--lora_target_modules nothing_here: no such"),
]


@pytest.mark.parametrize("flags, fragment", BAD, ids=[" ".join(b[0]) for b in BAD])
def test_a_variant_that_cannot_be_trained_is_one_line_and_nothing_is_written(flags, fragment, tiny, data, tmp_path,
                                                                             capsys):
    for dry in ((), ("--dry_run",)):
        code, _, err = cli(capsys, *argv(tiny, data, tmp_path / "out", "sft", *flags, *dry))
        one_error_line(code, err, fragment)
        assert not (tmp_path / "out").exists()


def test_the_dry_run_counts_doras_magnitudes(tiny, data, capsys):
    import json

    trained = {}
    for name, extra in (("lora", ()), ("dora", VARIANT)):
        code, out, err = cli(capsys, *argv(tiny, data, data / "never", "sft:split", *extra, "--dry_run", "--json"))
        assert code == 0, err
        plan = json.loads(out)
        trained[name] = plan["stages"]["train"]["models"]["dit"]["trainable_params"]
    assert trained["dora"] > trained["lora"]


# -- LoKr and LoHa --------------------------------------------------------------------------------------------------

# (family, kind): the flags of each case. The ranks are chosen for both of a LoKr's layouts: Qwen-Image's test DiT is
# 48 wide (factors 6 x 8), so rank 2 decomposes lokr_w2 and rank 4 keeps both factors whole (the scale folded into
# lokr_w1 in the file); SD 1.5's test UNet has both at rank 4. alpha 8 makes every scale other than 1.
LYCORIS_CASES = {("qwen_image", "lokr"): ("--lora_rank", "2"), ("qwen_image", "loha"): (),
                 ("sd15", "lokr"): (), ("sd15", "loha"): ("--lora_rank", "2")}


@pytest.fixture(scope="module")
def sd15(tmp_path_factory) -> Path:
    from unitgraph.backends.diffusion.families.sd15.tiny import write_tiny_models

    return write_tiny_models(tmp_path_factory.mktemp("sd15") / "models", size="test", seed=0)


def lycoris_argv(models: Path, data: Path, out: Path, task: str, family: str, kind: str, *extra: str) -> list[str]:
    """The recipe tests' command line for a case, at fp32 unless `extra` says otherwise (a later flag wins)."""
    return argv(models, data, out, task, "--lora_type", kind, "--lora_alpha", "8", *LYCORIS_CASES[family, kind],
                "--mixed_precision", "no", *extra, pipeline=family, dit="dit" if family == "qwen_image" else "unet")


@pytest.fixture(scope="module")
def lycoris_runs(tiny, sd15, data, tmp_path_factory):
    """Each case trained once unsplit over 2 epochs, on demand: {(family, kind): output folder}."""
    folder = tmp_path_factory.mktemp("lycoris-runs")
    done: dict[tuple[str, str], Path] = {}

    def run(family: str, kind: str, capsys) -> Path:
        if (family, kind) not in done:
            out = folder / f"{family}-{kind}"
            models = tiny if family == "qwen_image" else sd15
            code, _, err = cli(capsys, *lycoris_argv(models, data, out, "sft", family, kind, "--num_epochs", "2"))
            assert code == 0, err
            done[family, kind] = out
        return done[family, kind]

    return run


def base_model(models: Path, family: str):
    """A fresh copy of the family's denoiser from the test folder, and what it is called with."""
    import diffusers

    torch.manual_seed(0)
    if family == "qwen_image":
        model = diffusers.QwenImageTransformer2DModel.from_pretrained(str(models / "transformer"))
        c = model.config
        inputs = dict(hidden_states=torch.randn(2, 16, c.in_channels), encoder_hidden_states=torch.randn(2, 5, c.joint_attention_dim),
                      encoder_hidden_states_mask=torch.ones(2, 5), timestep=torch.tensor([0.3, 0.8]),
                      img_shapes=[[(1, 4, 4)], [(1, 4, 4)]], return_dict=False)
    elif family == "flux2_klein":
        model = diffusers.Flux2Transformer2DModel.from_pretrained(str(models / "transformer"))
        c = model.config
        img_ids, txt_ids = torch.zeros(16, 4), torch.zeros(5, 4)
        img_ids[:, 1], img_ids[:, 2], txt_ids[:, 3] = torch.arange(16) // 4, torch.arange(16) % 4, torch.arange(5)
        inputs = dict(hidden_states=torch.randn(1, 16, c.in_channels), encoder_hidden_states=torch.randn(1, 5, c.joint_attention_dim),
                      timestep=torch.tensor([0.5]), img_ids=img_ids[None], txt_ids=txt_ids[None], return_dict=False,
                      **({"guidance": torch.tensor([3.5])} if c.guidance_embeds else {}))
    else:
        model = diffusers.UNet2DConditionModel.from_pretrained(str(models / "unet"))
        c = model.config
        inputs = dict(sample=torch.randn(2, c.in_channels, 8, 8), timestep=torch.tensor([300, 800]),
                      encoder_hidden_states=torch.randn(2, 5, c.cross_attention_dim), return_dict=False)
    return model.eval(), inputs


def trained_model(models: Path, family: str, kind: str, out: Path):
    """The run's trained model: the base with peft's adapter holding the final training state's tensors (by their
    in-memory names, not through the LyCORIS file), at the run's targets, rank and alpha."""
    import json

    from unitgraph.backends.diffusion.registry import find_pipeline

    model, inputs = base_model(models, family)
    run = json.loads((out / "training_args.json").read_text())
    family_def = find_pipeline(family)[0]
    slot = family_def.model_slots[0]
    add_lora(model, slot, list(family_def.slot(slot).lora_targets), run["lora_rank"], run["lora_alpha"], 0, kind=kind)
    state = load_file(str(sorted((out / "state").glob("step-*"))[-1] / "trained.safetensors"))
    result = model.load_state_dict({k.split("/", 1)[1]: v for k, v in state.items()}, strict=False)
    assert not result.unexpected_keys and len(state) > 0
    assert all(k.split("/", 1)[1] not in result.missing_keys for k in state)
    return model.eval(), inputs


SPLIT_CASES = [(*case, "no") for case in LYCORIS_CASES] + [("qwen_image", "loha", "bf16"), ("sd15", "lokr", "bf16")]


@pytest.mark.parametrize("family, kind, precision", SPLIT_CASES, ids=["-".join(c) for c in SPLIT_CASES])
def test_a_lokr_or_loha_is_exact_when_split_and_written_in_lycoris_layout(family, kind, precision, tiny, sd15, data,
                                                                           lycoris_runs, tmp_path, capsys):
    """Split == unsplit bit for bit (losses and the written file), at fp32 and bf16; the file in LyCORIS' layout
    (`lycoris_` for a transformer, kohya's `lora_unet_` for a UNet; each module's factors and alpha), its tensors
    fp32 at bf16 too (the trained parameters stay fp32)."""
    models = tiny if family == "qwen_image" else sd15
    flags = ("--num_epochs", "2", "--mixed_precision", precision)
    if precision == "no":
        unsplit = lycoris_runs(family, kind, capsys)
    else:
        unsplit = tmp_path / "unsplit"
        code, _, err = cli(capsys, *lycoris_argv(models, data, unsplit, "sft", family, kind, *flags))
        assert code == 0, err
    code, _, err = cli(capsys, *lycoris_argv(models, data, tmp_path / "split", "sft:split", family, kind, *flags))
    assert code == 0, err
    la, lb = read_loss_csv(unsplit / "loss.csv"), read_loss_csv(tmp_path / "split" / "loss.csv")
    assert len(la) == 6 and [r["loss"] for r in la] == [r["loss"] for r in lb]
    wa, wb = load_file(str(unsplit / "epoch-1.safetensors")), load_file(str(tmp_path / "split" / "epoch-1.safetensors"))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    prefix = "lycoris_" if family == "qwen_image" else "lora_unet_"
    parts = ("lokr_w1", "lokr_w2") if kind == "lokr" else ("hada_w1_a", "hada_w2_b")
    assert all(k.startswith(prefix) and "." in k for k in wa) and not any("lora_A" in k for k in wa)
    assert all(v.dtype == torch.float32 for v in wa.values())
    modules = {k.split(".")[0] for k in wa}
    assert all(f"{m}.alpha" in wa and any(f"{m}.{p}" in wa or f"{m}.{p}_a" in wa for p in parts) for m in modules)


@pytest.mark.parametrize("family, kind", list(LYCORIS_CASES), ids=[f"{f}-{k}" for f, k in LYCORIS_CASES])
def test_lycoris_lora_loads_the_file_onto_a_fresh_base_and_computes_what_the_trained_model_does(
        family, kind, tiny, sd15, data, lycoris_runs, capsys):
    """lycoris-lora's own loader (create_lycoris_from_weights; for a UNet with its `lora_unet` prefix preset, as
    lycoris' kohya wrapper reads it) on a fresh copy of the base model, against peft's adapter holding the training
    state; then unitgraph's own readers of the file: --lora_checkpoint's into a fresh adapter, --preset_lora_path's
    merge into a fresh base."""
    lycoris = pytest.importorskip("lycoris")
    from unitgraph.backends.diffusion.models.lora import load_lora_checkpoint

    models = tiny if family == "qwen_image" else sd15
    out = lycoris_runs(family, kind, capsys)
    ckpt = out / "epoch-1.safetensors"
    trained, inputs = trained_model(models, family, kind, out)
    plain, _ = base_model(models, family)
    with torch.no_grad():
        expected, untrained = trained(**inputs)[0], plain(**inputs)[0]
    assert (expected - untrained).abs().max() > 1e-4  # the adapter has learnt something to reproduce
    fresh, _ = base_model(models, family)
    prefix = lycoris.LycorisNetwork.LORA_PREFIX
    if family == "sd15":
        lycoris.LycorisNetwork.apply_preset({"lora_prefix": "lora_unet"})
    try:
        network, _ = lycoris.create_lycoris_from_weights(1.0, str(ckpt), fresh)
    finally:
        lycoris.LycorisNetwork.LORA_PREFIX = prefix
    network.apply_to()
    assert len(network.loras) == len({k.split(".")[0] for k in load_file(str(ckpt))})
    with torch.no_grad():
        assert torch.allclose(fresh(**inputs)[0], expected, atol=2e-5, rtol=0)
    # --lora_checkpoint: a fresh adapter of the run's kind takes the file
    from unitgraph.backends.diffusion.registry import find_pipeline

    family_def = find_pipeline(family)[0]
    slot = family_def.model_slots[0]
    prefixes = {s.name: s.lora_prefix or s.name for s in family_def.slots if s.kind == "model"}
    again, _ = base_model(models, family)
    add_lora(again, slot, list(family_def.slot(slot).lora_targets), trained.peft_config["default"].r, 8.0, 5, kind=kind)
    load_lora_checkpoint(again, slot, ckpt, prefixes)
    merged, _ = base_model(models, family)
    assert merge_preset_lora(merged, slot, ckpt, prefixes[slot], prefixes=prefixes) == len(network.loras)
    with torch.no_grad():
        assert torch.allclose(again(**inputs)[0], expected, atol=2e-5, rtol=0)
        assert torch.allclose(merged(**inputs)[0], expected, atol=2e-5, rtol=0)


@pytest.mark.parametrize("family, kind", [("qwen_image", "lokr"), ("sd15", "loha")], ids=["qwen_image-lokr", "sd15-loha"])
def test_a_lokr_or_loha_run_resumes_exactly(family, kind, tiny, sd15, data, lycoris_runs, tmp_path, capsys):
    """One epoch, then --resume to two: the uninterrupted run's losses and file, bit for bit (the adapter's tensors are
    trained parameters like a LoRA's, in the state by their peft names)."""
    models = tiny if family == "qwen_image" else sd15
    whole = lycoris_runs(family, kind, capsys)
    out = tmp_path / "resumed"
    code, _, err = cli(capsys, *lycoris_argv(models, data, out, "sft", family, kind, "--num_epochs", "1"))
    assert code == 0, err
    code, printed, err = cli(capsys, *lycoris_argv(models, data, out, "sft", family, kind, "--num_epochs", "2", "--resume"))
    assert code == 0 and "resuming from" in printed + err, err
    assert [r["loss"] for r in read_loss_csv(whole / "loss.csv")] == [r["loss"] for r in read_loss_csv(out / "loss.csv")]
    wa, wb = load_file(str(whole / "epoch-1.safetensors")), load_file(str(out / "epoch-1.safetensors"))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    # a resume as the other kind is another training: refused in one line
    other = "loha" if kind == "lokr" else "lokr"
    code, _, err = cli(capsys, *lycoris_argv(models, data, out, "sft", family, kind, "--num_epochs", "2", "--resume",
                                             "--lora_type", other))
    one_error_line(code, err, "another lora_type", "keep --lora_type as it was")


def test_diffusers_loads_a_flux2_lokr_and_refuses_the_other_families_lycoris_files(tiny, sd15, data, lycoris_runs,
                                                                                   tmp_path, capsys):
    """diffusers' own readers (docs/objective.md, "LoRA variants"): the FLUX.2 pipelines' load_lora_weights reads a
    LoKr in LyCORIS' layout and computes what the trained model does; Qwen-Image's and SD 1.5's refuse a LoKr or LoHa
    (a ValueError, nothing loaded quietly)."""
    import diffusers

    from unitgraph.backends.diffusion.families.flux2.tiny import write_tiny_models

    models = write_tiny_models(tmp_path / "flux2", size="test", seed=0)
    out = tmp_path / "out"
    code, _, err = cli(capsys, *argv(models, data, out, "sft", "--lora_type", "lokr", "--lora_rank", "2", "--lora_alpha",
                                     "8", "--mixed_precision", "no", pipeline="flux2_klein"))
    assert code == 0, err
    trained, inputs = trained_model(models, "flux2_klein", "lokr", out)
    pipe = diffusers.Flux2KleinPipeline.from_pretrained(str(models))
    pipe.load_lora_weights(str(out / "epoch-0.safetensors"))
    with torch.no_grad():
        expected = trained(**inputs)[0]
        assert torch.allclose(pipe.transformer.eval()(**inputs)[0], expected, atol=2e-5, rtol=0)
        assert (expected - base_model(models, "flux2_klein")[0](**inputs)[0]).abs().max() > 1e-5
    for family, kind, cls, folder in (("qwen_image", "loha", diffusers.QwenImagePipeline, tiny),
                                      ("sd15", "lokr", diffusers.StableDiffusionPipeline, sd15)):
        pipe = cls.from_pretrained(str(folder))
        with pytest.raises(ValueError):
            pipe.load_lora_weights(str(lycoris_runs(family, kind, capsys) / "epoch-1.safetensors"))


def test_lycoris_files_are_refused_where_a_lora_is_read_and_by_lora_convert(tiny, data, lycoris_runs, tmp_path, capsys):
    ckpt = lycoris_runs("qwen_image", "lokr", capsys) / "epoch-1.safetensors"
    code, _, err = cli(capsys, "lora", "convert", str(ckpt), str(tmp_path / "out.safetensors"), "--to", "diffusers")
    one_error_line(code, err, "is a LoKr in LyCORIS' layout, not a LoRA", "ComfyUI")
    assert not (tmp_path / "out.safetensors").exists()
    for kind, fragment in (("lora", "the checkpoint is a LoKr and this run trains a plain LoRA"),
                           ("loha", "the checkpoint is a LoKr and this run trains a LoHa")):
        code, _, err = cli(capsys, *argv(tiny, data, tmp_path / kind, "sft", "--lora_type", kind, "--lora_checkpoint",
                                         str(ckpt)))
        one_error_line(code, err, fragment, "(lokr)")
    code, _, err = cli(capsys, *argv(tiny, data, tmp_path / "r4", "sft", "--lora_type", "lokr", "--lora_checkpoint",
                                     str(ckpt)))  # trained at rank 2
    one_error_line(code, err, "does not fit dit")


def test_zero3_refuses_lokr_and_dora_in_one_line(tiny, data, tmp_path, capsys):
    """ZeRO-3 partitions the base weight a LoKr layer reads the shape of, and the one DoRA reads whole (DoRA, LoKr
    and LoHa train under FSDP2: tests/test_engines.py)."""
    zero3 = tmp_path / "zero3.yaml"
    zero3.write_text("distributed_type: DEEPSPEED\ndeepspeed_config:\n  zero_stage: 3\nmixed_precision: 'no'\n"
                     "num_machines: 1\nnum_processes: 2\n")
    fsdp2 = tmp_path / "fsdp2.yaml"
    fsdp2.write_text("distributed_type: FSDP\nfsdp_config:\n  fsdp_version: 2\nmixed_precision: 'no'\n"
                     "num_machines: 1\nnum_processes: 2\n")
    for kind in ("lokr", "dora"):
        code, _, err = cli(capsys, *argv(tiny, data, tmp_path / "out", "sft", "--lora_type", kind, "--dry_run",
                                         "--config_file", str(zero3)))
        one_error_line(code, err, f"--lora_type {kind} with DeepSpeed ZeRO-3", "FSDP2, ZeRO-1/2 or data parallel")
    for kind in ("loha", "dora"):
        code, _, err = cli(capsys, *argv(tiny, data, tmp_path / "out", "sft", "--lora_type", kind, "--dry_run",
                                         "--config_file", str(fsdp2)))
        assert code == 0, err


def test_the_dry_run_counts_lokrs_and_lohas_tensors(tiny, data, capsys):
    """The memory plan's trainable parameters of the DiT are exactly the tensors peft's adapter adds to the loaded
    model."""
    import diffusers

    from unitgraph.backends.diffusion.families.qwen_image import DIT_LORA_TARGETS

    for kind in ("lokr", "loha"):
        code, out, err = cli(capsys, *argv(tiny, data, data / "never", "sft:split", "--lora_type", kind, "--dry_run",
                                           "--json"))
        assert code == 0, err
        import json

        planned = json.loads(out)["stages"]["train"]["models"]["dit"]["trainable_params"]
        model = diffusers.QwenImageTransformer2DModel.from_pretrained(str(tiny / "transformer"))
        add_lora(model, "dit", list(DIT_LORA_TARGETS), 4, None, 0, kind=kind)
        assert planned == sum(p.numel() for p in model.parameters() if p.requires_grad) > 0


def _toy_lycoris(tmp_path: Path, kind: str, change=None) -> tuple[Path, torch.nn.Module, torch.nn.Module]:
    """A LyCORIS file of a trained toy adapter as unitgraph writes it (two Linear layers: as a LoKr at rank 2, the
    first of two whole factors, the second's larger one decomposed), with `change(tensors)` applied; the toy base
    model, and the trained one."""
    from unitgraph.backends.diffusion.train.checkpoints import checkpoint_state, save_checkpoint

    torch.manual_seed(0)
    base = torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.Linear(16, 36))
    trained = torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.Linear(16, 36))
    trained.load_state_dict(base.state_dict())
    config = add_lora(trained, "dit", ["0", "1"], 2, 3.0, 0, kind=kind)
    with torch.no_grad():
        for p in trained.parameters():
            if p.requires_grad:
                p.copy_(torch.randn_like(p) * 0.3)
    path = tmp_path / f"{kind}.safetensors"
    save_checkpoint(path, checkpoint_state({"dit": trained}, "dit", [], {"dit": "transformer"}), "transformer", config,
                    prefixes={"dit": "transformer"})
    if change is not None:
        from safetensors.torch import save_file

        tensors = load_file(str(path))
        change(tensors)
        save_file(tensors, str(path))
    return path, base, trained


def test_a_lycoris_file_merges_as_the_adapter_computes(tmp_path):
    for kind in ("lokr", "loha"):
        path, base, trained = _toy_lycoris(tmp_path, kind)
        if kind == "lokr":
            assert {"lycoris_0.lokr_w2", "lycoris_1.lokr_w2_a", "lycoris_1.lokr_w2_b"} <= set(load_file(str(path)))
        x = torch.randn(4, 12)
        assert merge_preset_lora(base, "dit", path, "transformer", prefixes={"dit": "transformer"}) == 2
        with torch.no_grad():
            assert torch.allclose(base(x), trained(x), atol=1e-5, rtol=0)


def _put(key, value):
    return lambda t: t.__setitem__(key, value)


BAD_LYCORIS = [
    ("lokr", _put("lycoris_0.lokr_w1", torch.full((4, 4), float("nan"))), "holds NaN or infinite values"),
    ("lokr", lambda t: t.pop("lycoris_1.lokr_w1"), "give either lokr_w1 or both lokr_w1_a and lokr_w1_b"),
    ("lokr", _put("lycoris_0.lokr_t2", torch.ones(2, 2, 3, 3)), "a Tucker core"),
    ("loha", _put("lycoris_0.dora_scale", torch.ones(16, 1)), "a weight decomposition"),
    ("loha", _put("lycoris_0.alpha", torch.tensor(-1.0)), "is -1.0, not a positive finite number"),
    ("loha", _put("lycoris_0.alpha", torch.ones(2)), "not a single number"),
    ("loha", _put("lycoris_0.hada_w2_b", torch.ones(3, 12)), "a LoHa is hada_w1_a [out, rank]"),
    ("loha", _put("lycoris_0.hada_w1_a", torch.ones(16, 2, dtype=torch.int32)), "non-empty floating matrix"),
    ("lokr", _put("lora_te_0.lokr_w1", torch.ones(2, 2)), "belongs to no model of this family"),
    ("lokr", lambda t: t.update({"lycoris_0.lokr_w1": torch.ones(4, 2), "lycoris_0.lokr_w2": torch.ones(4, 2)}),
     "does not fit dit"),
    ("lokr", lambda t: t.update({"lycoris_0.hada_w1_a": torch.ones(16, 2)}), "has both LoKr and LoHa tensors"),
]


@pytest.mark.parametrize("kind, change, fragment", BAD_LYCORIS, ids=[b[2][:30] for b in BAD_LYCORIS])
def test_a_bad_lycoris_file_is_one_line_and_changes_nothing(kind, change, fragment, tmp_path):
    from unitgraph.backends.diffusion.errors import BackendError
    from unitgraph.backends.diffusion.models.lora import load_lora_checkpoint

    path, base, _ = _toy_lycoris(tmp_path, kind, change)
    before = {k: v.clone() for k, v in base.state_dict().items()}
    with pytest.raises(BackendError) as exc:
        merge_preset_lora(base, "dit", path, "transformer", prefixes={"dit": "transformer"})
    assert fragment in str(exc.value) and "\n" not in str(exc.value) and str(path) in str(exc.value)
    assert all(torch.equal(before[k], v) for k, v in base.state_dict().items())
    if "does not fit" in fragment:
        return  # a merge's own check; --lora_checkpoint's is by the adapter's shapes
    add_lora(base, "dit", ["0", "1"], 2, 3.0, 0, kind=kind)
    with pytest.raises(BackendError) as exc:
        load_lora_checkpoint(base, "dit", path, {"dit": "transformer"})
    assert fragment in str(exc.value) and "\n" not in str(exc.value)
