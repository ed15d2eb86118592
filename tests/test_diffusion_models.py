"""Tiny Qwen-Image models and slot-by-slot model loading (families/qwen_image/tiny.py, backends/diffusion/models/)."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("diffusers")
pytest.importorskip("transformers")

from safetensors.torch import load_file  # noqa: E402

from qwen_family import ALL_SLOTS, load_components, model_weight_files, resolve_components  # noqa: E402
from unitgraph.backends.diffusion.models import folders, sources  # noqa: E402
from unitgraph.backends.diffusion.families import qwen_image as Q  # noqa: E402
from unitgraph.backends.diffusion.families.qwen_image import tiny as T  # noqa: E402
from unitgraph.backends.diffusion.models.folders import ModelLoadError  # noqa: E402

SUBS = ("transformer", "vae", "text_encoder", "tokenizer", "scheduler")


@pytest.fixture(scope="session")
def tiny_root(tmp_path_factory) -> Path:
    """A test-size tiny pipeline, written once per session. Treat as read-only."""
    return T.write_tiny_models(tmp_path_factory.mktemp("tiny") / "qwen-image-tiny", size="test", seed=0)


@pytest.fixture
def tiny_copy(tiny_root, tmp_path) -> Path:
    """A private copy of the tiny pipeline that a test may damage."""
    dst = tmp_path / "copy"
    shutil.copytree(tiny_root, dst)
    return dst


def _digests(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def _assert_one_line(exc: ModelLoadError, *fragments: str) -> str:
    text = str(exc)
    assert "\n" not in text and text.strip() == text
    for fragment in fragments:
        assert fragment in text, (fragment, text)
    return text


def _same_state(a, b) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for key in sa:
        assert torch.equal(sa[key], sb[key]), key


# ----------------------------------------------------------------------------------------------
# tiny.py


def test_tiny_folder_layout(tiny_root):
    index = json.loads((tiny_root / "model_index.json").read_text())
    assert index["_class_name"] == "QwenImagePipeline"
    for sub in SUBS:
        assert sub in index and (tiny_root / sub).is_dir()
    assert (tiny_root / "transformer" / "diffusion_pytorch_model.safetensors").is_file()
    assert (tiny_root / "vae" / "diffusion_pytorch_model.safetensors").is_file()
    assert (tiny_root / "text_encoder" / "model.safetensors").is_file()
    assert not list(tiny_root.rglob("*.bin")) and not list(tiny_root.rglob("*.pt"))
    info = json.loads((tiny_root / "unitgraph_tiny.json").read_text())
    assert info["size"] == "test" and info["seed"] == 0
    scheduler = json.loads((tiny_root / "scheduler" / "scheduler_config.json").read_text())
    for key, value in Q.SCHEDULER_CONFIG.items():
        assert scheduler[key] == value, key


def test_tiny_sizes_are_consistent():
    for name, spec in T.SIZES.items():
        tf, vae, text = spec["transformer"], spec["vae"], spec["text"]
        assert sum(tf["axes_dims_rope"]) == tf["attention_head_dim"], name
        assert tf["in_channels"] == 4 * vae["z_dim"] and tf["out_channels"] == vae["z_dim"], name
        assert tf["joint_attention_dim"] == text["hidden_size"], name
        head_dim = text["hidden_size"] // text["num_attention_heads"]
        assert sum(text["mrope_section"]) * 2 == head_dim, name
        json.dumps(spec)  # plain JSON
    assert T.vae_geometry(T.SIZES["test"]["vae"]) == T.VaeGeometry(4, 4)
    assert T.vae_geometry(T.SIZES["demo"]["vae"]) == T.VaeGeometry(8, 16)


def test_tiny_reloads_bitwise(tiny_root):
    fresh = T.build_tiny_components("test", seed=0)
    loaded = load_components(ALL_SLOTS, model_paths=str(tiny_root))
    assert set(loaded) == set(ALL_SLOTS)
    _same_state(loaded["dit"], fresh["transformer"])
    _same_state(loaded["vae"], fresh["vae"])
    _same_state(loaded["text_encoder"], fresh["text_encoder"])
    for sub in ("transformer", "vae"):
        on_disk = load_file(str(tiny_root / sub / "diffusion_pytorch_model.safetensors"))
        state = fresh[sub].state_dict()
        assert on_disk.keys() == state.keys()
        assert all(torch.equal(on_disk[k], state[k]) for k in on_disk)
    text = "<|im_start|>user\na red cat<|im_end|>"
    assert loaded["tokenizer"](text).input_ids == fresh["tokenizer"](text).input_ids
    assert {k: v for k, v in loaded["scheduler"].config.items() if not k.startswith("_")} == dict(fresh["scheduler"].config)


def test_tiny_deterministic_by_seed(tiny_root, tmp_path):
    again = T.write_tiny_models(tmp_path / "again", size="test", seed=0)
    assert _digests(again) == _digests(tiny_root)
    other = _digests(T.write_tiny_models(tmp_path / "other", size="test", seed=1))
    base = _digests(tiny_root)
    for name in base:
        if name.endswith(".safetensors"):
            assert other[name] != base[name], name
        elif name != "unitgraph_tiny.json":
            assert other[name] == base[name], name


def test_tokenizer_template_matches_pipeline(tiny_root):
    from diffusers import QwenImagePipeline

    parts = load_components(ALL_SLOTS, model_paths=tiny_root)
    pipe = QwenImagePipeline(transformer=parts["dit"], vae=parts["vae"], text_encoder=parts["text_encoder"],
                             tokenizer=parts["tokenizer"], scheduler=parts["scheduler"])
    assert pipe.prompt_template_encode == T.PROMPT_TEMPLATE
    assert pipe.prompt_template_encode_start_idx == T.PROMPT_TEMPLATE_DROP == 34
    tok = parts["tokenizer"]
    prefix = T.PROMPT_TEMPLATE.split("{}")[0]
    ids = tok(prefix).input_ids
    assert len(ids) == 34
    assert tok.convert_ids_to_tokens(ids)[-3:] == ["<|im_start|>", "user", "Ċ"]
    # The pipeline drops exactly the system prefix: what remains is prompt + suffix.
    prompt = "a small red cat"
    full = tok(T.PROMPT_TEMPLATE.format(prompt)).input_ids
    assert full[:34] == ids
    with torch.no_grad():
        embeds, _ = pipe.encode_prompt(prompt, device=torch.device("cpu"))
    assert embeds.shape == (1, len(full) - 34, T.SIZES["test"]["text"]["hidden_size"])


def test_diffusers_pipeline_generates(tiny_root):
    from diffusers import QwenImagePipeline

    pipe = QwenImagePipeline.from_pretrained(str(tiny_root))
    pipe.set_progress_bar_config(disable=True)
    assert pipe.vae_scale_factor == 4

    def run():
        return pipe("a red cat on a blue chair", num_inference_steps=2, height=64, width=64,
                    generator=torch.Generator().manual_seed(0), output_type="pt").images

    image = run()
    assert image.shape == (1, 3, 64, 64)
    assert torch.isfinite(image).all()
    assert torch.equal(image, run())


def test_vae_geometry(tiny_root):
    vae = load_components(["vae"], model_paths=tiny_root)["vae"]
    expected = T.VaeGeometry(scale_factor=4, latent_channels=4)
    assert T.vae_geometry(vae) == expected
    assert T.vae_geometry(vae.config) == expected
    assert T.vae_geometry(tiny_root / "vae") == expected
    with pytest.raises(TypeError):
        T.vae_geometry(object())


# ----------------------------------------------------------------------------------------------
# Loading only the requested slots


def test_load_only_dit_with_other_folders_deleted(tiny_copy):
    for sub in ("vae", "text_encoder", "tokenizer", "scheduler"):
        shutil.rmtree(tiny_copy / sub)
    out = load_components(["dit"], model_paths=str(tiny_copy))
    assert list(out) == ["dit"]
    assert type(out["dit"]).__name__ == "QwenImageTransformer2DModel"
    assert not out["dit"].training
    with pytest.raises(ModelLoadError) as err:
        load_components(["vae"], model_paths=str(tiny_copy))
    _assert_one_line(err.value, str(tiny_copy / "vae"), "vae")


def test_load_encoders_with_dit_weights_corrupt(tiny_copy):
    weights = tiny_copy / "transformer" / "diffusion_pytorch_model.safetensors"
    weights.write_bytes(b"\x00garbage, not safetensors\xff" * 4)
    out = load_components(["vae", "text_encoder", "tokenizer", "scheduler"], model_paths=tiny_copy)
    assert set(out) == {"vae", "text_encoder", "tokenizer", "scheduler"}
    assert type(out["text_encoder"]).__name__ == "Qwen2_5_VLForConditionalGeneration"
    with pytest.raises(ModelLoadError) as err:
        load_components(["dit"], model_paths=tiny_copy)
    _assert_one_line(err.value, str(tiny_copy / "transformer"), "cannot load dit")


def test_component_folders_only_dit(tiny_root, tmp_path):
    lone = tmp_path / "my_dit"
    shutil.copytree(tiny_root / "transformer", lone)
    out = load_components(["dit", "scheduler"], model_paths=json.dumps([str(lone)]))
    assert type(out["dit"]).__name__ == "QwenImageTransformer2DModel"
    # No scheduler folder anywhere: Qwen-Image's built-in config.
    assert out["scheduler"].config["shift_terminal"] == 0.02
    assert resolve_components(["scheduler"], model_paths=lone)["scheduler"].is_default


# ----------------------------------------------------------------------------------------------
# Forms of model_paths


def test_model_paths_forms(tiny_root):
    comps = [str(tiny_root / s) for s in ("transformer", "vae", "text_encoder")]
    expect = {"dit": tiny_root / "transformer", "vae": tiny_root / "vae", "text_encoder": tiny_root / "text_encoder",
              "tokenizer": tiny_root / "tokenizer", "scheduler": tiny_root / "scheduler"}
    forms = [
        str(tiny_root),  # a pipeline folder as a single path
        json.dumps([str(tiny_root)]),  # JSON list with a pipeline folder
        json.dumps(comps),  # JSON list of component folders (tokenizer/scheduler found beside)
        json.dumps([[comps[0]], comps[1:]]),  # nested lists, as DiffSynth groups shards
        comps,  # python list
        [Path(c) for c in comps],
        [str(tiny_root / "transformer" / "diffusion_pytorch_model.safetensors"), comps[1],
         str(tiny_root / "text_encoder" / "model.safetensors")],  # weight files -> their folders
        tiny_root,  # a Path
    ]
    for form in forms:
        found = resolve_components(ALL_SLOTS, model_paths=form)
        assert {slot: src.path for slot, src in found.items()} == expect, form
        assert found["dit"].class_name == "QwenImageTransformer2DModel"
        assert found["vae"].class_name == "AutoencoderKLQwenImage"
        assert found["text_encoder"].class_name.startswith("Qwen2_5_VL")


def test_component_overrides_pipeline_and_tokenizer_path(tiny_root, tmp_path):
    custom = tmp_path / "finetuned_dit"
    shutil.copytree(tiny_root / "transformer", custom)
    tok = tmp_path / "tok"
    shutil.copytree(tiny_root / "tokenizer", tok)
    found = resolve_components(ALL_SLOTS, model_paths=[str(tiny_root), str(custom)], tokenizer_path=str(tok))
    assert found["dit"].path == custom
    assert found["vae"].path == tiny_root / "vae"
    assert found["tokenizer"].path == tok
    tokenizer = load_components(["tokenizer"], model_paths=[str(custom)], tokenizer_path=tok)["tokenizer"]
    assert len(tokenizer(T.PROMPT_TEMPLATE.split("{}")[0]).input_ids) == 34


def test_model_weight_files(tiny_root, tmp_path):
    files = model_weight_files("dit", model_paths=tiny_root)
    assert files == [tiny_root / "transformer" / "config.json",
                     tiny_root / "transformer" / "diffusion_pytorch_model.safetensors"]
    assert model_weight_files("vae", model_paths=tiny_root, include_config=False) == [
        tiny_root / "vae" / "diffusion_pytorch_model.safetensors"]
    te = model_weight_files("text_encoder", model_paths=tiny_root)
    assert tiny_root / "text_encoder" / "model.safetensors" in te
    assert tiny_root / "text_encoder" / "config.json" in te
    assert tiny_root / "tokenizer" / "tokenizer.json" in model_weight_files("tokenizer", model_paths=tiny_root)
    assert model_weight_files("scheduler", model_paths=tiny_root) == [tiny_root / "scheduler" / "scheduler_config.json"]
    assert model_weight_files("scheduler", model_paths=tiny_root / "vae") == []
    # A sharded transformer: every shard is listed, and it loads.
    dit = load_components(["dit"], model_paths=tiny_root)["dit"]
    sharded = tmp_path / "sharded"
    dit.save_pretrained(str(sharded), safe_serialization=True, max_shard_size="300KB")
    shards = model_weight_files("dit", model_paths=sharded, include_config=False)
    assert len(shards) >= 2 and all(p.suffix == ".safetensors" for p in shards)
    _same_state(load_components(["dit"], model_paths=sharded)["dit"], dit)
    # DiffSynth lists shard files one by one: they name their folder once.
    assert resolve_components(["dit"], model_paths=json.dumps([str(p) for p in shards]))["dit"].path == sharded


# ----------------------------------------------------------------------------------------------
# Errors


def test_error_bad_model_paths_strings():
    with pytest.raises(ModelLoadError) as err:
        sources.parse_model_paths('["a", "b"')
    _assert_one_line(err.value, "not valid JSON")
    with pytest.raises(ModelLoadError) as err:
        sources.parse_model_paths('{"dit": "a"}')
    _assert_one_line(err.value, "JSON list")
    with pytest.raises(ModelLoadError) as err:
        sources.parse_model_paths("[1, 2]")
    _assert_one_line(err.value, "path strings")
    with pytest.raises(ModelLoadError) as err:
        load_components(["dit"], model_paths="[not json\n at all")
    _assert_one_line(err.value, "not valid JSON")
    with pytest.raises(ModelLoadError) as err:
        sources.parse_model_id_with_origin_paths("Qwen-Image-without-colon")
    _assert_one_line(err.value, "Qwen-Image-without-colon", "org/name:sub/pattern")
    assert sources.parse_model_paths(None) == [] and sources.parse_model_paths("  ") == []
    assert sources.parse_model_paths('"/a/b"') == ["/a/b"]


def test_error_path_does_not_exist(tmp_path):
    missing = tmp_path / "nowhere"
    with pytest.raises(ModelLoadError) as err:
        load_components(["dit"], model_paths=json.dumps([str(missing)]))
    _assert_one_line(err.value, str(missing), "does not exist")
    with pytest.raises(ModelLoadError) as err:
        load_components(["tokenizer"], model_paths=[], tokenizer_path=missing)
    _assert_one_line(err.value, str(missing), "does not exist")


def test_error_not_a_model_folder(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "readme.txt").write_text("hello")
    with pytest.raises(ModelLoadError) as err:
        load_components(["dit"], model_paths=str(empty))
    _assert_one_line(err.value, str(empty), "not a diffusers/transformers model folder")
    bad = tmp_path / "badjson"
    bad.mkdir()
    (bad / "config.json").write_text("{ not json")
    with pytest.raises(ModelLoadError) as err:
        load_components(["dit"], model_paths=str(bad))
    _assert_one_line(err.value, str(bad / "config.json"), "cannot read JSON")
    unsupported = tmp_path / "unet"
    unsupported.mkdir()
    (unsupported / "config.json").write_text(json.dumps({"_class_name": "UNet2DConditionModel"}))
    with pytest.raises(ModelLoadError) as err:
        load_components(["dit"], model_paths=str(unsupported))
    _assert_one_line(err.value, str(unsupported), "UNet2DConditionModel")
    llama = tmp_path / "llama"
    llama.mkdir()
    (llama / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama"}))
    with pytest.raises(ModelLoadError) as err:
        load_components(["text_encoder"], model_paths=str(llama))
    _assert_one_line(err.value, str(llama), "LlamaForCausalLM")


def test_error_wrong_kind_for_slot(tiny_root):
    with pytest.raises(ModelLoadError) as err:
        load_components(["dit"], model_paths=str(tiny_root / "vae"))
    _assert_one_line(err.value, str(tiny_root / "vae"), "vae", "dit", "QwenImageTransformer2DModel")
    with pytest.raises(ModelLoadError) as err:
        load_components(["text_encoder"], model_paths=[str(tiny_root / "vae"), str(tiny_root / "transformer")])
    _assert_one_line(err.value, "text_encoder", str(tiny_root / "vae"), str(tiny_root / "transformer"))


def test_error_slot_not_provided(tiny_root, tiny_copy, tmp_path):
    with pytest.raises(ModelLoadError) as err:
        load_components(["dit"])
    _assert_one_line(err.value, "dit", "--model_paths")
    shutil.rmtree(tiny_copy / "text_encoder")
    with pytest.raises(ModelLoadError) as err:
        load_components(["text_encoder"], model_paths=tiny_copy)
    _assert_one_line(err.value, str(tiny_copy / "text_encoder"))
    lone = tmp_path / "lone_te"
    shutil.copytree(tiny_root / "text_encoder", lone)
    with pytest.raises(ModelLoadError) as err:
        load_components(["tokenizer"], model_paths=lone)
    _assert_one_line(err.value, "tokenizer", "--tokenizer_path")
    with pytest.raises(ModelLoadError) as err:
        load_components(["unet"], model_paths=tiny_root)
    _assert_one_line(err.value, "unet", "unknown model slot")


def test_error_duplicate_and_missing_weights(tiny_root, tmp_path):
    other = tmp_path / "dit2"
    shutil.copytree(tiny_root / "transformer", other)
    with pytest.raises(ModelLoadError) as err:
        load_components(["dit"], model_paths=[str(tiny_root / "transformer"), str(other)])
    _assert_one_line(err.value, "more than one path provides dit", str(other))
    (other / "diffusion_pytorch_model.safetensors").unlink()
    with pytest.raises(ModelLoadError) as err:
        load_components(["dit"], model_paths=[str(other)])
    _assert_one_line(err.value, str(other), "no safetensors weights")


# ----------------------------------------------------------------------------------------------
# modelscope, offline, from a cache the test writes


@pytest.fixture
def ms_cache(tiny_root, tmp_path, monkeypatch) -> Path:
    pytest.importorskip("modelscope")
    monkeypatch.setenv(folders.OFFLINE_ENV, "1")
    cache = tmp_path / "mscache"
    # The current layout: C/models/<org>--<name>/snapshots/master/
    shutil.copytree(tiny_root, cache / "models" / "Qwen--Qwen-Image" / "snapshots" / "master")
    # The older layout C/models/<org>/<name>, holding a bare transformer folder.
    shutil.copytree(tiny_root / "transformer", cache / "models" / "acme" / "tiny-dit")
    return cache


def test_modelscope_offline_loading(ms_cache, tiny_root):
    spec = ("Qwen/Qwen-Image:transformer/diffusion_pytorch_model*.safetensors,"
            "Qwen/Qwen-Image:vae/diffusion_pytorch_model.safetensors,"
            "Qwen/Qwen-Image:text_encoder/model*.safetensors")
    snap = ms_cache / "models" / "Qwen--Qwen-Image" / "snapshots" / "master"
    found = resolve_components(ALL_SLOTS, model_id_with_origin_paths=spec, cache_dir=ms_cache)
    assert found["dit"].path == snap / "transformer"
    assert found["vae"].path == snap / "vae"
    assert found["text_encoder"].path == snap / "text_encoder"
    assert found["tokenizer"].path == snap / "tokenizer"  # DiffSynth's default tokenizer/ origin
    out = load_components(["dit", "vae", "text_encoder", "tokenizer"], model_id_with_origin_paths=spec,
                          cache_dir=ms_cache)
    reference = load_components(["dit", "vae"], model_paths=tiny_root)
    _same_state(out["dit"], reference["dit"])
    _same_state(out["vae"], reference["vae"])
    # Origin pattern at the snapshot root (no subfolder), older cache layout.
    legacy = load_components(["dit"], model_id_with_origin_paths="acme/tiny-dit:diffusion_pytorch_model*.safetensors",
                             cache_dir=ms_cache)
    _same_state(legacy["dit"], reference["dit"])
    # Mixed with local paths; the tokenizer given as a model-id origin.
    mixed = resolve_components(["dit", "vae", "tokenizer"], model_paths=[str(tiny_root / "vae")],
                               model_id_with_origin_paths="acme/tiny-dit:diffusion_pytorch_model*.safetensors",
                               tokenizer_path="Qwen/Qwen-Image:tokenizer/", cache_dir=ms_cache)
    assert mixed["vae"].path == tiny_root / "vae"
    assert mixed["tokenizer"].path == snap / "tokenizer"


def test_modelscope_missing_model(ms_cache):
    spec = "acme/tiny-dit:diffusion_pytorch_model*.safetensors,nobody/missing:vae/diffusion_pytorch_model.safetensors"
    # The missing vae is not looked up when only the dit is requested.
    assert set(load_components(["dit"], model_id_with_origin_paths=spec, cache_dir=ms_cache)) == {"dit"}
    with pytest.raises(ModelLoadError) as err:
        load_components(["vae"], model_id_with_origin_paths=spec, cache_dir=ms_cache)
    _assert_one_line(err.value, "nobody/missing", "not found", "offline: UNITGRAPH_OFFLINE", "--model_paths")
    with pytest.raises(ModelLoadError) as err:
        load_components(["dit"], model_id_with_origin_paths="Qwen/Qwen-Image:controlnet/x.safetensors",
                        cache_dir=ms_cache)
    _assert_one_line(err.value, "controlnet")
