"""The diffusion backend: registry, data, cache, units, and the stages end to end on test-size models."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")
pytest.importorskip("diffusers")
pytest.importorskip("accelerate")
pytest.importorskip("peft")

from safetensors.torch import load_file  # noqa: E402

import unitgraph  # noqa: E402
from unitgraph.backends.diffusion.errors import BackendError  # noqa: E402
from unitgraph.backends.diffusion.args import make_args
from unitgraph.backends.diffusion.cache.cache import Cache  # noqa: E402
from unitgraph.backends.diffusion.cache.entries import read_entry, write_entry
from unitgraph.backends.diffusion.data.dataset import DiffusionDataset, read_metadata, write_synthetic_dataset  # noqa: E402
from unitgraph.backends.diffusion.randomness import derive_seed, permutation  # noqa: E402
from unitgraph.backends.diffusion.registry import PIPELINES  # noqa: E402
from unitgraph.backends.diffusion.stages import run  # noqa: E402
from unitgraph.backends.diffusion.train.loop import read_loss_csv  # noqa: E402

SIZE = 64
VENV_BIN = Path(sys.executable).parent


@pytest.fixture(scope="session")
def dataset(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("data")
    write_synthetic_dataset(folder, count=4, size=SIZE, seed=1, edit=True, distill=True)
    return folder


def common(tiny: Path, dataset: Path, **extra):
    kwargs = dict(dataset_base_path=str(dataset), dataset_metadata_path=str(dataset / "metadata.csv"),
                  model_paths=str(tiny), lora_base_model="dit", lora_target_modules="to_q,to_k,to_v,to_out.0",
                  lora_rank=4, max_pixels=SIZE * SIZE, seed=7, learning_rate=1e-3, progress=False, plot=False)
    kwargs.update(extra)
    return kwargs


def quiet(_text: str) -> None:
    pass


def split_run(tiny, dataset, out: Path, **extra):
    """sft:data_process into out/cache, then sft:train from it into out/train."""
    family = extra.pop("family", "sft")
    dp = run(make_args(task=f"{family}:data_process", output_path=str(out / "cache"), **common(tiny, dataset, **extra)), echo=quiet)
    train_kwargs = common(tiny, dataset, **extra)
    train_kwargs.update(dataset_base_path=str(out / "cache"), dataset_metadata_path=None)
    tr = run(make_args(task=f"{family}:train", output_path=str(out / "train"), **train_kwargs), echo=quiet)
    return dp, tr


def assert_same_training(a: Path, b: Path, checkpoint: str) -> None:
    la, lb = read_loss_csv(a / "loss.csv"), read_loss_csv(b / "loss.csv")
    assert [(r["step"], r["epoch"]) for r in la] == [(r["step"], r["epoch"]) for r in lb]
    assert [r["loss"] for r in la] == pytest.approx([r["loss"] for r in lb], abs=1e-6, rel=0)
    wa, wb = load_file(str(a / checkpoint)), load_file(str(b / checkpoint))
    assert set(wa) == set(wb) and wa
    for key in wa:
        assert torch.allclose(wa[key], wb[key], atol=1e-6, rtol=0), key


# ------------------------------------------------------------------------------------------------
# fast: no models


def test_registry_plan_stays_torch_free():
    code = ("import sys, unitgraph; p = unitgraph.load_pipeline('diffusion:qwen_image'); "
            "unitgraph.split(p, lora_base_model='dit'); "
            "bad = [m for m in ('torch', 'diffusers', 'transformers', 'accelerate') if m in sys.modules]; print(bad)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_qwen_image_plans():
    pipeline = unitgraph.load_pipeline("diffusion:qwen_image")
    lora = unitgraph.split(pipeline, lora_base_model="dit")
    assert lora.data_process_models == ["text_encoder", "vae"] and lora.train_models == ["dit"]
    assert {"NoiseInitializer", "TimestepSampler"} <= set(lora.train_units)
    # the posterior mean (DiffSynth's latent) is deterministic: stage 1 computes it and the cache holds that one tensor
    assert "PosteriorMean" in lora.data_process_units
    assert ("input_latents", "PosteriorMean") in lora.cache_entries
    assert not {("latent_mean", "ImageEncoder"), ("latent_logvar", "ImageEncoder")} & set(lora.cache_entries)
    # --vae_latents sample: a fresh draw each epoch, so the cache holds the posterior (mean and log-variance)
    from unitgraph.backends.diffusion.flowmatch import with_vae_latents

    from unitgraph.backends.diffusion.registry import find_pipeline

    sampled_def = with_vae_latents(find_pipeline("qwen_image")[1], "sample")
    sampled = unitgraph.split(sampled_def.spec_pipeline, lora_base_model="dit")
    assert "LatentSampler" in sampled.train_units and "PosteriorMean" not in sampled.train_units + sampled.data_process_units
    assert {("latent_mean", "ImageEncoder"), ("latent_logvar", "ImageEncoder")} <= set(sampled.cache_entries)
    assert unitgraph.verify(sampled_def.spec_pipeline, sampled) == []
    te = unitgraph.split(pipeline, trainable_models=["text_encoder"], lora_base_model="dit")
    assert "PromptEncoder" in te.train_units and "vae" not in te.train_models
    assert ("prompt", None) in te.cache_entries
    for plan in (lora, te, unitgraph.split(pipeline, lora_base_model="dit", cache_mode="versioned")):
        assert unitgraph.verify(pipeline, plan) == []
    distill = unitgraph.split(PIPELINES["qwen_image_distill"](), lora_base_model="dit")
    assert distill.train_units == [] and distill.train_models == ["dit"]


def test_derived_randomness():
    assert derive_seed(1, "a", 0) == derive_seed(1, "a", 0) != derive_seed(1, "a", 1) != derive_seed(2, "a", 0)
    assert sorted(permutation(10, 0, "shuffle", 0)) == list(range(10))
    assert permutation(10, 0, "shuffle", 0) != permutation(10, 0, "shuffle", 1)


def test_metadata_formats_and_errors(tmp_path, dataset):
    rows = read_metadata(dataset / "metadata.csv")
    (tmp_path / "m.json").write_text(json.dumps(rows))
    (tmp_path / "m.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    assert read_metadata(tmp_path / "m.json") == rows == read_metadata(tmp_path / "m.jsonl")
    params = ["image", "edit_image", "prompt"]
    ds = DiffusionDataset(dataset, tmp_path / "m.jsonl", params)
    sample = ds.sample(0)
    assert sample["edit_image"] is None and sample["image"].size == (SIZE, SIZE) and isinstance(sample["prompt"], str)
    with_edit = DiffusionDataset(dataset, dataset / "metadata.csv", params, extra_inputs=["edit_image"],
                                 image_params=("image", "edit_image"))
    assert with_edit.sample(0)["edit_image"] is not None
    same = DiffusionDataset(dataset, dataset / "metadata.csv", params)  # csv and jsonl rows: the same samples
    assert same.sample_id(0) == ds.sample_id(0) != ds.sample_id(1) and with_edit.sample_id(0) != ds.sample_id(0)
    with pytest.raises(BackendError, match="not a folder"):
        DiffusionDataset(tmp_path / "nope", dataset / "metadata.csv", params)
    with pytest.raises(BackendError, match="missing column 'mask'"):
        DiffusionDataset(dataset, dataset / "metadata.csv", params, extra_inputs=["mask"])
    (tmp_path / "bad.csv").write_text("image,caption\nimages/000.png,x\n")
    with pytest.raises(BackendError, match="missing column 'prompt'"):
        DiffusionDataset(dataset, tmp_path / "bad.csv", params)
    (tmp_path / "gone.csv").write_text("image,prompt\nimages/missing.png,x\n")
    with pytest.raises(BackendError, match="missing file 'images/missing.png'"):
        DiffusionDataset(dataset, tmp_path / "gone.csv", params).sample(0)
    with pytest.raises(BackendError, match="unsupported metadata format"):
        read_metadata(dataset / "images" / "000.png")


def test_cache_entry_round_trip(tmp_path):
    from PIL import Image

    values = {"a": torch.randn(1, 3, 4), "none": None, "text": "a cat", "n": 3, "x": 0.1 + 0.2,
              "shapes": [[(1, 8, 8), (1, 4, 4)]], "image": Image.new("RGB", (4, 2), (1, 2, 3)),
              "nested": [torch.ones(2), {"k": torch.zeros(1)}]}
    write_entry(tmp_path / "e.safetensors", values, {"sample_id": "abc", "index": 0})
    got, meta = read_entry(tmp_path / "e.safetensors")
    assert meta == {"sample_id": "abc", "index": 0}
    assert torch.equal(got["a"], values["a"]) and got["none"] is None and got["text"] == "a cat"
    assert got["n"] == 3 and got["x"] == values["x"] and got["shapes"] == [[(1, 8, 8), (1, 4, 4)]]
    assert got["image"].size == (4, 2) and got["image"].getpixel((0, 0)) == (1, 2, 3)
    assert torch.equal(got["nested"][0], torch.ones(2)) and torch.equal(got["nested"][1]["k"], torch.zeros(1))
    with pytest.raises(BackendError, match="no manifest"):
        Cache(tmp_path).open_for_training(unitgraph.split(PIPELINES["qwen_image"](), lora_base_model="dit"))


@settings(max_examples=60, deadline=None)
@given(shape=st.lists(st.integers(1, 4), min_size=2, max_size=5), data=st.data())
def test_a_cached_view_comes_back_with_its_layout(tmp_path_factory, shape, data):
    """A dense permuted view (a `rearrange` of a contiguous tensor) is cached in memory order and read back as the
    same view: equal values and strides, so `randn_like` on it draws the same noise at the same positions as on the
    original, which the split run needs (DiffSynth's loss draws like FLUX.2's permuted `input_latents`). A tensor
    that is not dense (a slice) comes back contiguous with its values. Only where the writer asks (DiffSynth's units)."""
    order = data.draw(st.permutations(range(len(shape))))
    base = torch.randn(*[shape[d] for d in order])
    view = base.permute(sorted(range(len(order)), key=order.__getitem__))  # logical shape `shape`, memory `order`
    sliced = torch.randn(*shape, 3)[..., :2]
    path = tmp_path_factory.mktemp("layout") / "e.safetensors"
    write_entry(path, {"view": view, "sliced": sliced, "nested": [view]}, {}, keep_layout=True)
    got, _ = read_entry(path)
    for value in (got["view"], got["nested"][0]):
        assert torch.equal(value, view)
        assert [s for s, n in zip(value.stride(), value.shape) if n > 1] == [
            s for s, n in zip(view.stride(), view.shape) if n > 1]
        torch.manual_seed(0)
        expected = torch.randn_like(view)
        torch.manual_seed(0)
        assert torch.equal(torch.randn_like(value), expected)
    assert torch.equal(got["sliced"], sliced) and got["sliced"].is_contiguous()
    # unitgraph's own families' entries (no keep_layout) stay contiguous: a batched stage 1 writes the same bytes
    write_entry(path, {"view": view}, {})
    plain, _ = read_entry(path)
    assert torch.equal(plain["view"], view) and plain["view"].is_contiguous()


@settings(max_examples=40, deadline=None)
@given(shape=st.lists(st.integers(1, 4), min_size=0, max_size=4), double=st.booleans(), transpose=st.booleans())
def test_a_complex_tensor_comes_back_bit_for_bit(tmp_path_factory, shape, double, transpose):
    """safetensors has no complex dtypes; a complex value of a unit (Boogu-Image's rotary frequencies, complex128)
    is cached as its real and imaginary parts and read back as the same complex tensor, dtype and bits, also nested
    and when it was a transposed view."""
    dtype = torch.complex128 if double else torch.complex64
    value = torch.randn(tuple(shape), dtype=dtype)
    if transpose and value.dim() >= 2:
        value = value.transpose(0, 1)
    path = tmp_path_factory.mktemp("complex") / "e.safetensors"
    write_entry(path, {"freqs": value, "nested": [{"f": value}], "plain": torch.ones(2)}, {}, keep_layout=True)
    got, _ = read_entry(path)
    for back in (got["freqs"], got["nested"][0]["f"]):
        assert back.dtype == dtype and back.shape == value.shape
        assert torch.equal(torch.view_as_real(back), torch.view_as_real(value.contiguous()))
    assert torch.equal(got["plain"], torch.ones(2))


@pytest.mark.parametrize("stored", [torch.zeros(2, 3), torch.zeros(2, 2, dtype=torch.int64), torch.zeros(())])
def test_a_damaged_complex_record_in_an_entry_is_one_line(stored):
    import json as _json

    from safetensors.torch import save

    from unitgraph.backends.diffusion.cache.entries import HEADER_KEY, parse_entry

    header = _json.dumps({"meta": {}, "values": {"v": {"__complex__": "v"}}})
    data = save({"v": stored}, metadata={HEADER_KEY: header})
    with pytest.raises(BackendError, match="unreadable cache entry"):
        parse_entry(data, "entry.safetensors")


@pytest.mark.parametrize("order", [[5, 0], [0, 0], [1], "01", [0.5, 1]])
def test_a_damaged_layout_record_in_an_entry_is_one_line(order):
    import json as _json

    from safetensors.torch import save

    from unitgraph.backends.diffusion.cache.entries import HEADER_KEY, parse_entry

    header = _json.dumps({"meta": {}, "values": {"v": {"__tensor__": "v", "__order__": order}}})
    data = save({"v": torch.zeros(2, 3)}, metadata={HEADER_KEY: header})
    with pytest.raises(BackendError, match="unreadable cache entry"):
        parse_entry(data, "entry.safetensors")


def test_args_errors():
    with pytest.raises(BackendError, match="--task"):
        make_args(task="nope", lora_base_model="dit")
    with pytest.raises(BackendError, match="nothing to train"):
        make_args(task="sft")
    with pytest.raises(BackendError, match="multiple of 16"):
        make_args(lora_base_model="dit", height=100, width=96)


# ------------------------------------------------------------------------------------------------
# units against diffusers


def test_prompt_encoding_matches_diffusers(tiny):
    from diffusers import QwenImagePipeline

    from qwen_family import load_components
    from unitgraph.backends.diffusion.context import UnitContext
    from unitgraph.backends.diffusion.families.qwen_image.units import prompt_encoder

    models = load_components(["text_encoder", "tokenizer"], model_paths=str(tiny))
    ours = prompt_encoder(UnitContext(models=models), {"prompt": "a red circle on a blue background"})
    pipe = QwenImagePipeline.from_pretrained(str(tiny))
    emb, mask = pipe.encode_prompt("a red circle on a blue background", device="cpu")
    assert torch.equal(ours["prompt_emb"], emb)
    assert mask is None or torch.equal(ours["prompt_emb_mask"], mask)


# ------------------------------------------------------------------------------------------------
# end to end (test-size models)


@pytest.mark.slow
@pytest.mark.parametrize("cache_mode", ["latest", "versioned"])
def test_split_equals_unsplit(tiny, dataset, tmp_path, cache_mode):
    extra = dict(num_epochs=2, dataset_repeat=2, gradient_accumulation_steps=2, cache_mode=cache_mode)
    unsplit = run(make_args(task="sft", output_path=str(tmp_path / "sft"), **common(tiny, dataset, **extra)), echo=quiet)
    dp, tr = split_run(tiny, dataset, tmp_path, **extra)
    assert unsplit.steps == tr.steps == 2 * 4 * 2 // 2
    assert dp.samples == 4 and len(list((tmp_path / "cache" / "entries").iterdir())) == 4  # repeat ignored in stage 1
    assert_same_training(tmp_path / "sft", tmp_path / "train", "epoch-1.safetensors")
    manifest = json.loads((tmp_path / "cache" / "manifest.json").read_text())
    assert manifest["status"] == "complete" and manifest["plan_fingerprint"] == tr.plan.fingerprint
    rows = read_loss_csv(tmp_path / "train" / "loss.csv")
    assert rows[0]["elapsed_s"] >= 0 and all(a["elapsed_s"] <= b["elapsed_s"] for a, b in zip(rows, rows[1:]))
    for name in ("plan.json", "training_args.json", "epoch-0.safetensors"):
        assert (tmp_path / "train" / name).is_file()


@pytest.mark.slow
def test_text_encoder_trained_split_equals_unsplit(tiny, dataset, tmp_path):
    """Full training of the text encoder plus LoRA on the DiT: prompt encoding moves to stage 2 by itself."""
    extra = dict(trainable_models="text_encoder", num_epochs=2, extra_inputs="edit_image", save_steps=3)
    run(make_args(task="sft", output_path=str(tmp_path / "sft"), **common(tiny, dataset, **extra)), echo=quiet)
    dp, tr = split_run(tiny, dataset, tmp_path, **extra)
    assert "PromptEncoder" in tr.plan.train_units and tr.plan.data_process_models == ["vae"]
    assert_same_training(tmp_path / "sft", tmp_path / "train", "epoch-1.safetensors")
    assert_same_training(tmp_path / "sft", tmp_path / "train", "step-6.safetensors")
    weights = load_file(str(tmp_path / "train" / "epoch-1.safetensors"))
    assert any(k.startswith("text_encoder.") and "lora" not in k for k in weights)
    assert any(k.startswith("transformer.") and "lora_A" in k for k in weights)
    first = load_file(str(tmp_path / "sft" / "step-3.safetensors"))
    assert any(not torch.equal(first[k], weights[k]) for k in first)  # training changed the text encoder


@pytest.mark.slow
def test_stage2_without_encoder_folders_and_fingerprint_check(tiny, dataset, tmp_path):
    pipeline_copy = tmp_path / "models"
    shutil.copytree(tiny, pipeline_copy)
    run(make_args(task="sft:data_process", output_path=str(tmp_path / "cache"), **common(pipeline_copy, dataset)), echo=quiet)
    shutil.rmtree(pipeline_copy / "vae")
    shutil.rmtree(pipeline_copy / "text_encoder")
    shutil.rmtree(pipeline_copy / "tokenizer")
    kwargs = common(pipeline_copy, dataset, dataset_base_path=str(tmp_path / "cache"), dataset_metadata_path=None)
    result = run(make_args(task="sft:train", output_path=str(tmp_path / "train"), **kwargs), echo=quiet)
    assert result.steps == 4 and result.plan.train_models == ["dit"]
    with pytest.raises(BackendError, match="cache was made under another plan"):
        run(make_args(task="sft:train", output_path=str(tmp_path / "t2"), trainable_models="text_encoder", **kwargs), echo=quiet)
    with pytest.raises(BackendError, match="cache was made under another plan"):
        run(make_args(task="sft:train", output_path=str(tmp_path / "t3"), **{**kwargs, "cache_mode": "versioned"}), echo=quiet)


@pytest.mark.slow
def test_stage1_never_reads_transformer_weights(tiny, dataset, tmp_path):
    pipeline_copy = tmp_path / "models"
    shutil.copytree(tiny, pipeline_copy)
    (pipeline_copy / "transformer" / "diffusion_pytorch_model.safetensors").write_bytes(b"corrupt")
    result = run(make_args(task="sft:data_process", output_path=str(tmp_path / "cache"), **common(pipeline_copy, dataset)),
                 echo=quiet)
    assert result.samples == 4


@pytest.mark.slow
def test_split_reuses_cache_and_lora_loads_in_diffusers(tiny, dataset, tmp_path):
    from diffusers import QwenImagePipeline

    from qwen_family import load_components
    from unitgraph.backends.diffusion.models.lora import add_lora, load_lora_checkpoint

    args = common(tiny, dataset, lora_alpha=8.0, remove_prefix_in_ckpt="pipe.dit.")
    first = run(make_args(task="sft:split", output_path=str(tmp_path / "out"), **args), echo=quiet)
    assert not first.cache_reused and (tmp_path / "out" / "cache" / "manifest.json").is_file()
    # a re-run into the same folder moves the finished run aside (--overwrite) and reuses its cache
    again = run(make_args(task="sft:split", output_path=str(tmp_path / "out"), overwrite=True, **args), echo=quiet)
    assert again.cache_reused and again.replaced is not None and (again.replaced / "epoch-0.safetensors").is_file()
    ckpt = tmp_path / "out" / "epoch-0.safetensors"

    # ours, in memory: the trained adapter loaded back through peft
    dit = load_components(["dit"], model_paths=str(tiny))["dit"]
    add_lora(dit, "dit", ["to_q", "to_k", "to_v", "to_out.0"], 4, 8.0, seed=0)
    load_lora_checkpoint(dit, "dit", ckpt, {"dit": "transformer"})
    # diffusers' own loader on the same file
    pipe = QwenImagePipeline.from_pretrained(str(tiny))
    base = pipe.transformer
    gen = torch.Generator().manual_seed(0)
    inputs = dict(hidden_states=torch.randn(1, 64, 16, generator=gen), encoder_hidden_states=torch.randn(1, 5, 16, generator=gen),
                  encoder_hidden_states_mask=torch.ones(1, 5, dtype=torch.long), timestep=torch.tensor([0.5]),
                  img_shapes=[[(1, 8, 8)]], return_dict=False)
    with torch.no_grad():
        before = base(**inputs)[0]
        pipe.load_lora_weights(str(ckpt.parent), weight_name=ckpt.name)
        after = pipe.transformer(**inputs)[0]
        expected = dit(**inputs)[0]
    assert not torch.allclose(before, after)
    assert torch.allclose(after, expected, atol=1e-5)

    # the trained LoRA as a preset merged into the DiT, and as a checkpoint to resume from
    preset = run(make_args(task="sft:split", output_path=str(tmp_path / "preset"), preset_lora_path=str(ckpt),
                           preset_lora_model="dit", **args), echo=quiet)
    resumed = run(make_args(task="sft:split", output_path=str(tmp_path / "resumed"), lora_checkpoint=str(ckpt), **args),
                  echo=quiet)
    assert preset.cache_reused is False  # another output folder: its own cache
    assert preset.losses[0] != first.losses[0] and resumed.losses[0] != first.losses[0]


@pytest.mark.slow
def test_direct_distill_split_equals_unsplit(tiny, dataset, tmp_path):
    extra = dict(num_epochs=1, extra_inputs="seed,num_inference_steps,cfg_scale")
    unsplit = run(make_args(task="direct_distill", output_path=str(tmp_path / "sft"), **common(tiny, dataset, **extra)), echo=quiet)
    dp, tr = split_run(tiny, dataset, tmp_path, family="direct_distill", **extra)
    assert tr.plan.pipeline == "qwen_image_distill" and tr.plan.train_units == []
    assert unsplit.steps == tr.steps == 4
    assert_same_training(tmp_path / "sft", tmp_path / "train", "epoch-0.safetensors")


@pytest.mark.slow
def test_modelscope_offline_stage1(tiny, dataset, tmp_path, monkeypatch):
    pytest.importorskip("modelscope")
    snapshot = tmp_path / "ms" / "models" / "Qwen--Qwen-Image" / "snapshots" / "master"
    shutil.copytree(tiny, snapshot)
    monkeypatch.setenv("UNITGRAPH_OFFLINE", "1")
    kwargs = common(tiny, dataset, model_paths=None, modelscope_cache_dir=str(tmp_path / "ms"),
                    model_id_with_origin_paths="Qwen/Qwen-Image:vae/diffusion_pytorch_model.safetensors,"
                                               "Qwen/Qwen-Image:text_encoder/model*.safetensors")
    result = run(make_args(task="sft:data_process", output_path=str(tmp_path / "cache"), **kwargs), echo=quiet)
    assert result.samples == 4


# ------------------------------------------------------------------------------------------------
# the command line


def _cli(*argv: str, env: dict | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([str(VENV_BIN / "unitgraph"), *argv], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


@pytest.mark.slow
def test_cli_train_errors_are_one_line(tiny, dataset, tmp_path):
    base = ["train", "--dataset-base-path", str(dataset), "--dataset_metadata_path", str(dataset / "metadata.csv"),
            "--model_paths", str(tiny), "--output_path", str(tmp_path / "o")]
    bad = _cli(*base, "--lora_base_model", "unet")
    assert bad.returncode == 2 and "not a model of pipeline" in bad.stderr and len(bad.stderr.strip().splitlines()) == 1
    missing = _cli(*base[:2], str(tmp_path / "nowhere"), *base[3:], "--lora_base_model", "dit")
    assert missing.returncode == 2 and "not a folder" in missing.stderr
    cache = _cli("train", "--task", "sft:train", "--dataset_base_path", str(tmp_path), "--model_paths", str(tiny),
                 "--lora_base_model", "dit")
    assert cache.returncode == 2 and "manifest" in cache.stderr and "Traceback" not in cache.stderr


@settings(max_examples=200, deadline=None)
@given(st.integers(min_value=-(2**70), max_value=2**70),
       st.lists(st.one_of(st.text(), st.integers(), st.floats(allow_nan=False), st.booleans(), st.none()), max_size=4))
def test_derive_seed_hashes_the_purpose_path_as_json_dumps_prints_it(seed, purpose):
    """The kept encoder prints what json.dumps with compact separators prints: seeds never change with it."""
    import hashlib
    import json

    text = json.dumps([int(seed), [str(p) for p in purpose]], separators=(",", ":"))
    want = int.from_bytes(hashlib.sha256(text.encode("utf-8")).digest()[:8], "big") & ((1 << 63) - 1)
    assert derive_seed(seed, *purpose) == want
