"""LoRA files in ComfyUI's layout (`--lora_format comfyui`, `lora convert --to comfyui`): the denoiser's LoRA under
`diffusion_model.<release module>` as ComfyUI's generic reader takes it.

The file must compute what the trained model computes: written from a tiny model of a flow-matching DiT whose
release fuses q, k and v (FLUX.1) and of a UNet (SD 1.5), merged as ComfyUI merges it (an oracle written here from
ComfyUI's rule: alpha / rank * lora_up @ lora_down, added to the release module's weight), into the release
checkpoint (diffusers' own single-file converters read it back into diffusers' names), it equals the adapted
model's weights; unitgraph's reader gives the same adapter back; a round trip through `lora convert` gives the same
model. Each family's release names agree with diffusers' conversion of its release checkpoint.
"""

from __future__ import annotations

import importlib
import json

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("diffusers")
pytest.importorskip("peft")

from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402
from diffusers.loaders import single_file_utils as sfu  # noqa: E402

from clitools import cli  # noqa: E402
from unitgraph.backends.diffusion import registry  # noqa: E402
from unitgraph.backends.diffusion.args import make_args  # noqa: E402
from unitgraph.backends.diffusion.errors import BackendError  # noqa: E402
from unitgraph.backends.diffusion.models.lora import (add_lora, load_lora_checkpoint, merge_preset_lora,  # noqa: E402
                                                      read_lora_file)
from unitgraph.backends.diffusion.train.checkpoints import checkpoint_state, convert, save_checkpoint  # noqa: E402

FAMILIES = ("qwen_image", "flux", "flux2", "z_image", "wan", "ltx2", "sd15", "sdxl")
# diffusers' converters of each release checkpoint into its names (None: the release is in diffusers' names already)
CONVERTERS = {"flux2": sfu.convert_flux2_transformer_checkpoint_to_diffusers,
              "z_image": sfu.convert_z_image_transformer_checkpoint_to_diffusers,
              "wan": sfu.convert_wan_transformer_to_diffusers, "ltx2": sfu.convert_ltx2_transformer_to_diffusers}
# the modules a LoRA goes on: every Linear of the model (a fused module's parts all, or some of them)
TARGETS = {"flux": ["to_q", "to_k", "to_v", "to_out.0", "add_k_proj", "norm_out.linear", "proj_mlp", "proj_out"],
           "sd15": ["to_q", "to_k", "to_v", "to_out.0", "ff.net.0.proj", "ff.net.2", "time_emb_proj"]}


def family(name: str):
    return next(f for f in registry.families() if f.name == name)


@pytest.fixture(scope="module")
def denoisers():
    """The tiny denoiser of each family (test size), built once."""
    out = {}
    for name in FAMILIES:
        components = importlib.import_module(f"unitgraph.backends.diffusion.families.{name}.tiny").build_tiny_components(
            "test", 0)
        out[name] = components["unet" if "unet" in components else "transformer"]
    return out


def release_state(model, names) -> dict[str, torch.Tensor]:
    """The model's weights under their release names (a fused module's parts stacked in its rows), as the names say."""
    state, seen = model.state_dict(), {}
    for module, layer in model.named_modules():
        if module and isinstance(layer, (torch.nn.Linear, torch.nn.Conv2d, torch.nn.GroupNorm, torch.nn.LayerNorm)):
            fused = names.release(module)
            if fused is not None:
                seen.setdefault(fused.release, fused)
    out = {}
    for release, fused in seen.items():
        for tail in ("weight", "bias"):
            parts = [state.get(f"{p}.{tail}") for p, _ in fused.parts]
            if all(p is not None for p in parts):
                whole = torch.cat(parts)
                out[f"{release}.{tail}"] = whole.roll(whole.shape[0] // 2, 0) if fused.swap_halves else whole
    return out


@pytest.mark.parametrize("name", FAMILIES)
def test_release_names_agree_with_diffusers_conversion_of_the_release(name, denoisers):
    """Every Linear of the tiny denoiser has a release module, the names go both ways, and the release checkpoint
    they make, read by diffusers' own converter of that release (the LDM converter for a UNet), gives back exactly
    diffusers' weights. (FLUX.1's names are checked against its single-file reader below.)"""
    model = denoisers[name]
    fam = family(name)
    names = fam.comfyui_names(fam.model_slots[0]).for_config(dict(model.config))
    for module, layer in model.named_modules():
        if isinstance(layer, torch.nn.Linear):
            fused = names.release(module)
            assert fused is not None, module
            assert names.diffusers(fused.release) == fused
            # a release name that is also a diffusers module name means that module
            if fused.release in dict(model.named_modules()):
                assert fused.parts == ((fused.release, 1),)
    ckpt = release_state(model, names)
    state = model.state_dict()
    if name in ("sd15", "sdxl"):
        back = sfu.convert_ldm_unet_checkpoint({f"model.diffusion_model.{k}": v for k, v in ckpt.items()},
                                               dict(model.config))
        assert set(back) == set(state)
    elif name in CONVERTERS:
        back = CONVERTERS[name](dict(ckpt))
    else:
        back = ckpt if name == "qwen_image" else None
    if back is None:
        return
    assert back and all(torch.equal(back[k], state[k]) for k in back), [k for k in back if not torch.equal(back[k], state[k])]


def test_flux_release_names_are_the_single_file_readers(denoisers):
    """FLUX.1's release names and fused parts are those of its single-file reader (flux/single_file.py), which reads
    Black Forest Labs' release file: the same module, the same parts in the same rows, the same half swap."""
    from unitgraph.backends.diffusion.families.flux import single_file

    model = denoisers["flux"]
    names = family("flux").comfyui_names("dit")
    plan = single_file._dit_plan(dict(model.config))
    linears = {m for m, layer in model.named_modules() if isinstance(layer, torch.nn.Linear)}
    checked = 0
    for key, move in plan.items():
        parts = tuple(p.removesuffix(".weight") for p, _ in move.parts)
        if not key.endswith(".weight") or not set(parts) <= linears:
            continue
        fused = names.diffusers(key.removesuffix(".weight"))
        assert tuple(p for p, _ in fused.parts) == parts
        total = sum(rows for _, rows in move.parts)
        units = sum(n for _, n in fused.parts)
        assert [rows for _, rows in move.parts] == [total // units * n for _, n in fused.parts]
        assert fused.swap_halves == (move.transform == "swap_halves")
        checked += 1
    assert checked == len({names.release(m).release for m in linears})


# ---- a file must compute what the trained model computes


def adapted(model, name: str, rank: int = 3, alpha: float = 5.0, seed: int = 0, rslora: bool = False):
    """A copy of `model` with a LoRA on the family's test targets, lora_B random (a trained-looking adapter)."""
    import copy

    model = copy.deepcopy(model).float()
    add_lora(model, "dit", TARGETS[name], rank, alpha, seed=seed, rslora=rslora)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for module, param in model.named_parameters():
            if "lora_B" in module:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.1)
    return model


def merged(model) -> dict[str, torch.Tensor]:
    """The adapted model's weights, each module's delta added: what the trained model computes."""
    out = {}
    for module, layer in model.named_modules():
        if hasattr(layer, "lora_A") and "default" in getattr(layer, "lora_A", {}):
            out[f"{module}.weight"] = layer.get_base_layer().weight + layer.get_delta_weight("default")
    return out


def comfyui_merge(file: dict[str, torch.Tensor], release: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """ComfyUI's merge of a LoRA, written from its rule (comfy/weight_adapter/lora.py, comfy/lora.py): the keys
    `diffusion_model.<m>.lora_up.weight` / `lora_down.weight` / `alpha` patch the model's weight `<m>.weight` by
    alpha / rank * up @ down, rank the rows of lora_down, 1 without an alpha."""
    out = dict(release)
    for key in file:
        if key.endswith(".lora_up.weight"):
            module = key[len("diffusion_model."):-len(".lora_up.weight")]
            up, down = file[key].float(), file[key.replace("lora_up", "lora_down")].float()
            alpha = file.get(f"diffusion_model.{module}.alpha")
            scale = float(alpha) / down.shape[0] if alpha is not None else 1.0
            out[f"{module}.weight"] = out[f"{module}.weight"] + scale * (up @ down)
    return out


UNETS = {"flux": "dit", "sd15": "unet"}


def write(model, name: str, path, layout: str = "comfyui"):
    fam = family(name)
    prefixes = fam.lora_prefixes()
    slot = fam.model_slots[0]
    state = checkpoint_state({slot: model}, slot, [], prefixes)
    save_checkpoint(path, state, prefixes[slot], model.peft_config["default"], layout=layout, prefixes=prefixes)
    return path


@pytest.mark.parametrize("name", ["flux", "sd15"])
@pytest.mark.parametrize("rslora", [False, True])
def test_a_comfyui_file_computes_what_the_trained_model_computes(name, rslora, denoisers, tmp_path):
    """Written from the adapted tiny model, merged as ComfyUI merges it into the release checkpoint and read back into
    diffusers' names by diffusers' own converter (the single-file reader for FLUX.1), every weight equals the adapted
    model's; read by unitgraph's reader and merged as a preset, the same."""
    model = adapted(denoisers[name], name, rslora=rslora)
    path = write(model, name, tmp_path / "lora.safetensors")
    file = load_file(str(path))
    assert all(k.startswith("diffusion_model.") for k in file)
    fam = family(name)
    names = fam.comfyui_names(fam.model_slots[0]).for_config(dict(model.config))
    base = denoisers[name].float()
    if name == "flux":
        from unitgraph.backends.diffusion.families.flux.single_file import TRANSFORMER, _dit_plan

        # the whole release file of the base model, by the single-file reader's own plan (its inverse)
        state, release = base.state_dict(), {}
        for key, move in _dit_plan(dict(base.config)).items():
            whole = torch.cat([state[p] for p, _ in move.parts])
            release[key] = whole.roll(whole.shape[0] // 2, 0) if move.transform == "swap_halves" else whole
        back = TRANSFORMER.convert(comfyui_merge(file, release))
    else:
        patched = comfyui_merge(file, release_state(base, names))
        back = sfu.convert_ldm_unet_checkpoint({f"model.diffusion_model.{k}": v for k, v in patched.items()},
                                               dict(model.config))
    want = merged(model)
    assert want
    for key, value in want.items():
        torch.testing.assert_close(back[key], value, rtol=1e-5, atol=1e-6)
    untouched = [k for k in base.state_dict() if k not in want]
    assert all(torch.equal(back[k], base.state_dict()[k]) for k in untouched)
    # unitgraph's reader: a preset merged into the base model gives the same weights
    import copy

    preset = copy.deepcopy(base)
    merge_preset_lora(preset, fam.model_slots[0], path, fam.lora_prefixes()[fam.model_slots[0]], fam.lora_prefixes())
    for key, value in want.items():
        torch.testing.assert_close(preset.state_dict()[key], value, rtol=1e-5, atol=1e-6)


def test_fused_modules_are_read_back_as_the_adapter_that_wrote_them(denoisers, tmp_path):
    """--lora_checkpoint of a comfyui file continues the same adapter: each part's lora_A and lora_B (the header's
    blocks), not the fused rank; and the file records how the fused modules were stacked."""
    model = adapted(denoisers["flux"], "flux")
    path = write(model, "flux", tmp_path / "lora.safetensors")
    from safetensors import safe_open

    with safe_open(str(path), "pt") as handle:
        blocks = json.loads(handle.metadata()["comfyui_blocks"])
    assert blocks["double_blocks.0.img_attn.qkv"] == [[f"transformer_blocks.0.attn.to_{p}", 3] for p in "qkv"]
    # linear1's MLP part has no LoRA: zero rows, no rank
    assert blocks["single_blocks.0.linear1"][3] == ["single_transformer_blocks.0.proj_mlp", 3]
    import copy

    again = copy.deepcopy(denoisers["flux"]).float()
    add_lora(again, "dit", TARGETS["flux"], 3, 5.0, seed=9)
    load_lora_checkpoint(again, "dit", path, family("flux").lora_prefixes())
    mine, theirs = model.state_dict(), again.state_dict()
    for key in mine:
        if "lora_" in key:
            torch.testing.assert_close(theirs[key], mine[key], rtol=0, atol=0)


def test_a_fused_lora_of_comfyui_s_own_is_read_exactly(denoisers, tmp_path):
    """A LoRA trained on a fused module (a full rank-R lora_down, as ComfyUI's trainer or DiffSynth's fused DiT make it)
    is no block-diagonal stack: each part gets the whole lora_down and its rows of lora_up, the same delta."""
    base = denoisers["flux"].float()
    gen = torch.Generator().manual_seed(3)
    hidden = base.config.num_attention_heads * base.config.attention_head_dim
    up, down = torch.randn(3 * hidden, 2, generator=gen), torch.randn(2, hidden, generator=gen)
    path = tmp_path / "fused.safetensors"
    save_file({"diffusion_model.double_blocks.0.img_attn.qkv.lora_up.weight": up,
               "diffusion_model.double_blocks.0.img_attn.qkv.lora_down.weight": down,
               "diffusion_model.double_blocks.0.img_attn.qkv.alpha": torch.tensor(4.0)}, str(path))
    lora = read_lora_file(path, "dit", family("flux").lora_prefixes())
    assert lora.layout == "comfyui" and lora.ranks == {f"transformer_blocks.0.attn.to_{p}": 2 for p in "qkv"}
    for i, p in enumerate("qkv"):
        module = f"transformer_blocks.0.attn.to_{p}"
        delta = lora.scales[module] * lora.weights[f"{module}.lora_B.weight"] @ lora.weights[f"{module}.lora_A.weight"]
        torch.testing.assert_close(delta, 2.0 * up[i * hidden:(i + 1) * hidden] @ down)


def test_convert_round_trip_diffusers_comfyui_diffusers(denoisers, tmp_path, capsys):
    """`lora convert` diffusers -> comfyui -> diffusers gives the same file's tensors and alpha (the same model), and
    the comfyui file merges to the same weights as the diffusers one."""
    model = adapted(denoisers["flux"], "flux")
    first = write(model, "flux", tmp_path / "a.safetensors", layout="diffusers")
    code, out, err = cli(capsys, "lora", "convert", str(first), str(tmp_path / "b.safetensors"), "--to", "comfyui",
                         "--pipeline", "flux")
    assert code == 0, err
    assert "from the diffusers to the comfyui layout" in out
    code, out, err = cli(capsys, "lora", "convert", str(tmp_path / "b.safetensors"), str(tmp_path / "c.safetensors"),
                         "--to", "diffusers", "--pipeline", "flux")
    assert code == 0, err
    assert "from the comfyui to the diffusers layout" in out
    a, c = load_file(str(first)), load_file(str(tmp_path / "c.safetensors"))
    assert set(a) == set(c) and all(torch.equal(a[k], c[k]) for k in a)
    prefixes = family("flux").lora_prefixes()
    assert read_lora_file(tmp_path / "c.safetensors", "dit", prefixes).scales == \
        read_lora_file(first, "dit", prefixes).scales
    import copy

    one, two = copy.deepcopy(denoisers["flux"]).float(), copy.deepcopy(denoisers["flux"]).float()
    merge_preset_lora(one, "dit", first, "transformer", prefixes)
    merge_preset_lora(two, "dit", tmp_path / "b.safetensors", "transformer", prefixes)
    for key, value in one.state_dict().items():
        torch.testing.assert_close(two.state_dict()[key], value, rtol=1e-5, atol=1e-6)


# ---- bad input: one line


def _pair(module: str, rows: int = 8, cols: int = 8, rank: int = 2) -> dict[str, torch.Tensor]:
    return {f"diffusion_model.{module}.lora_up.weight": torch.ones(rows, rank),
            f"diffusion_model.{module}.lora_down.weight": torch.ones(rank, cols)}


BAD = {
    "another-familys-modules": ({**_pair("input_blocks.1.1.proj_in")}, "is no module of FLUX.1's release checkpoint"),
    "a-half-pair": ({"diffusion_model.double_blocks.0.img_attn.proj.lora_up.weight": torch.ones(8, 2)},
                    "has only its lora_up"),
    "ranks-differ": ({"diffusion_model.double_blocks.0.img_attn.proj.lora_up.weight": torch.ones(8, 2),
                      "diffusion_model.double_blocks.0.img_attn.proj.lora_down.weight": torch.ones(3, 8)},
                     "their ranks differ"),
    "rows-do-not-split": (_pair("single_blocks.0.linear1", rows=9), "do not split into its 7 parts"),
    "a-dora-scale": ({**_pair("double_blocks.0.img_attn.proj"),
                      "diffusion_model.double_blocks.0.img_attn.proj.dora_scale": torch.ones(8)},
                     "ComfyUI's DoRA scale"),
    "a-bad-alpha": ({**_pair("double_blocks.0.img_attn.proj"),
                     "diffusion_model.double_blocks.0.img_attn.proj.alpha": torch.tensor(-1.0)}, "not a positive"),
    "nan": ({**_pair("double_blocks.0.img_attn.proj"),
             "diffusion_model.double_blocks.0.img_attn.proj.lora_up.weight": torch.full((8, 2), float("nan"))},
            "NaN or infinite"),
    "a-vector": ({"diffusion_model.double_blocks.0.img_attn.proj.lora_up.weight": torch.ones(8),
                  "diffusion_model.double_blocks.0.img_attn.proj.lora_down.weight": torch.ones(2, 8)}, "a LoRA weight is a floating matrix"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_comfyui_files_are_one_line_naming_the_file(case, tmp_path, capsys):
    tensors, said = BAD[case]
    path = tmp_path / f"{case}.safetensors"
    save_file(tensors, str(path))
    code, out, err = cli(capsys, "lora", "convert", str(path), str(tmp_path / "out.safetensors"), "--to", "diffusers",
                         "--pipeline", "flux")
    assert code == 2 and said in err and str(path) in err, err
    assert len(err.strip().splitlines()) == 1
    assert not (tmp_path / "out.safetensors").exists()


def test_a_dora_is_refused_for_comfyui_and_the_opensource_flag_selects_it(tmp_path):
    """DiffSynth's --align_to_opensource_format writes ComfyUI's layout; a DoRA cannot be written there exactly."""
    with pytest.raises(BackendError, match="dora_scale divides by the base weight's row norms"):
        make_args(lora_base_model="dit", lora_type="dora", lora_format="comfyui", output_path=str(tmp_path)).validate()
    with pytest.raises(BackendError, match="dora_scale divides by the base weight's row norms"):
        make_args(lora_base_model="dit", lora_type="dora", align_to_opensource_format=True,
                  output_path=str(tmp_path)).validate()
    with pytest.raises(BackendError, match="the flag selects ComfyUI's layout"):
        make_args(lora_base_model="dit", align_to_opensource_format=True, lora_format="diffsynth",
                  output_path=str(tmp_path)).validate()
    assert make_args(lora_base_model="dit", align_to_opensource_format=True).output_format() == "comfyui"
    assert make_args(lora_base_model="dit").output_format() == "diffusers"


# ---- the reader, on any file: a checked LoRA or one line


_MODULES = ["double_blocks.0.img_attn.qkv", "double_blocks.0.img_attn.proj", "single_blocks.0.linear1",
            "final_layer.adaLN_modulation.1", "input_blocks.1.1.proj_in", "double_blocks.0.img_mlp.0"]


@st.composite
def comfy_files(draw):
    tensors = {}
    for module in draw(st.lists(st.sampled_from(_MODULES), min_size=0, max_size=4, unique=True)):
        rank = draw(st.integers(1, 3))
        rows = draw(st.sampled_from([7, 8, 12, 14, 28]))
        halves = draw(st.sampled_from([("up", "down"), ("up",), ("down",), ("up", "down", "alpha")]))
        if "up" in halves:
            tensors[f"diffusion_model.{module}.lora_up.weight"] = torch.randn(rows, draw(st.sampled_from([rank, rank + 1])))
        if "down" in halves:
            tensors[f"diffusion_model.{module}.lora_down.weight"] = torch.randn(rank, 8)
        if "alpha" in halves:
            tensors[f"diffusion_model.{module}.alpha"] = torch.tensor(draw(st.sampled_from([4.0, 0.0, -2.0])))
    return tensors


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(comfy_files())
def test_the_reader_gives_exact_deltas_or_one_line(tmp_path, tensors):
    path = tmp_path / "file.safetensors"
    save_file(tensors, str(path))
    prefixes = family("flux").lora_prefixes()
    try:
        lora = read_lora_file(path, "dit", prefixes)
    except BackendError as error:
        assert "\n" not in str(error) and str(path) in str(error)
        return
    names = family("flux").comfyui_names("dit")
    # every release module's delta is its parts' deltas stacked (halves swapped back where the release swaps them)
    for key in tensors:
        if not key.endswith(".lora_up.weight"):
            continue
        module = key[len("diffusion_model."):-len(".lora_up.weight")]
        up, down = tensors[key], tensors[key.replace("lora_up", "lora_down")]
        alpha = tensors.get(f"diffusion_model.{module}.alpha")
        want = (float(alpha) / down.shape[0] if alpha is not None else 1.0) * up @ down
        fused = names.diffusers(module)
        got = torch.cat([lora.scales[p] * lora.weights[f"{p}.lora_B.weight"] @ lora.weights[f"{p}.lora_A.weight"]
                         for p, _ in fused.parts])
        if fused.swap_halves:
            got = got.roll(got.shape[0] // 2, 0)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


# ---- a training run writes it


def test_a_run_with_lora_format_comfyui_writes_the_same_adapter(tiny, tmp_path):
    """The same training (alpha 8 over rank 4) written as diffusers and, by DiffSynth's --align_to_opensource_format,
    as comfyui: the comfyui file holds only ComfyUI's keys, and reads back to the diffusers file's deltas."""
    from unitgraph.backends.diffusion.data.dataset import write_synthetic_dataset
    from unitgraph.backends.diffusion.stages import run

    data = tmp_path / "data"
    write_synthetic_dataset(data, count=2, size=32, seed=4)
    common = dict(dataset_base_path=str(data), dataset_metadata_path=str(data / "metadata.csv"), model_paths=str(tiny),
                  lora_base_model="dit", lora_target_modules="to_q,to_k,to_v,to_out.0", lora_rank=4, lora_alpha=8.0,
                  learning_rate=1e-2, max_pixels=32 * 32, seed=3, progress=False, plot=False)
    files = {}
    for layout, extra in (("diffusers", {}), ("comfyui", {"align_to_opensource_format": True})):
        result = run(make_args(task="sft:split", output_path=str(tmp_path / layout), cache_path=str(tmp_path / "cache"),
                               **common, **extra), echo=lambda _t: None)
        files[layout] = result.last_checkpoint
    keys = load_file(str(files["comfyui"]))
    assert keys and all(k.startswith("diffusion_model.transformer_blocks.") and
                        k.rsplit(".", 2)[-2:] in (["lora_up", "weight"], ["lora_down", "weight"]) or k.endswith(".alpha")
                        for k in keys)
    assert {float(v) for k, v in keys.items() if k.endswith(".alpha")} == {8.0}
    prefixes = family("qwen_image").lora_prefixes()
    ours, theirs = (read_lora_file(files[layout], "dit", prefixes) for layout in ("comfyui", "diffusers"))
    assert ours.layout == "comfyui" and ours.modules == theirs.modules and ours.scales == theirs.scales
    for key, value in theirs.weights.items():
        torch.testing.assert_close(ours.weights[key], value, rtol=0, atol=0)


def test_a_unet_file_says_its_layers_per_block_for_a_reader_without_the_model(denoisers, tmp_path):
    """The LDM names depend on the UNet's layers per block (1 in the tiny UNet, 2 in the released ones): the header
    keeps it, so `lora convert` (no model at hand) reads the file back to the adapter's own modules and deltas."""
    model = adapted(denoisers["sd15"], "sd15")
    path = write(model, "sd15", tmp_path / "unet.safetensors")
    prefixes = family("sd15").lora_prefixes()
    convert(path, tmp_path / "back.safetensors", "diffusers", "unet", prefixes)
    lora = read_lora_file(tmp_path / "back.safetensors", "unet", prefixes)
    want = merged(model)
    assert sorted(f"{m}.weight" for m in lora.modules) == sorted(want)
    for module in lora.modules:
        delta = lora.scales[module] * lora.weights[f"{module}.lora_B.weight"] @ lora.weights[f"{module}.lora_A.weight"]
        base = model.get_submodule(module).get_base_layer().weight
        torch.testing.assert_close(base + delta, want[f"{module}.weight"], rtol=1e-5, atol=1e-6)
