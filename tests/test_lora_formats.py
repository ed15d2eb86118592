"""LoRA files in diffusers' and DiffSynth-Studio's layouts: both reproduce the in-memory model, DiffSynth's own
loader fuses the diffsynth layout, `unitgraph lora convert` turns one into the other, and flags that do
nothing here say so once."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
diffusers = pytest.importorskip("diffusers")
pytest.importorskip("peft")

from safetensors.torch import load_file  # noqa: E402

from qwen_family import QWEN, load_components  # noqa: E402
from unitgraph.backends.diffusion.args import make_args  # noqa: E402
from unitgraph.backends.diffusion.data.dataset import write_synthetic_dataset  # noqa: E402
from unitgraph.backends.diffusion.models.lora import add_lora, load_lora_checkpoint  # noqa: E402
from unitgraph.backends.diffusion.stages import run  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
DIFFSYNTH_LOADER = REPO / ".venv" / "diffsynth-wheel" / "diffsynth" / "utils" / "lora" / "general.py"
SIZE = 32
TARGETS = "to_q,to_k,to_v,to_out.0"
PREFIXES = {"dit": "transformer", "text_encoder": "text_encoder", "vae": "vae"}


@pytest.fixture(scope="module")
def trained(tiny, tmp_path_factory):
    """The same training (alpha 8 over rank 4) written in both layouts."""
    data = tmp_path_factory.mktemp("data")
    write_synthetic_dataset(data, count=3, size=SIZE, seed=4)
    out = tmp_path_factory.mktemp("runs")
    common = dict(dataset_base_path=str(data), dataset_metadata_path=str(data / "metadata.csv"), model_paths=str(tiny),
                  lora_base_model="dit", lora_target_modules=TARGETS, lora_rank=4, lora_alpha=8.0, learning_rate=1e-2,
                  max_pixels=SIZE * SIZE, seed=3, progress=False, plot=False)
    files = {}
    for layout, extra in (("diffusers", {}), ("diffsynth", {"remove_prefix_in_ckpt": "pipe.dit."})):
        result = run(make_args(task="sft:split", output_path=str(out / layout), lora_format=layout,
                               cache_path=str(out / "cache"), **common, **extra), echo=lambda _t: None)
        files[layout] = result.last_checkpoint
    return files


def adapter_from(tiny: Path, path: Path):
    dit = load_components(["dit"], model_paths=str(tiny))["dit"]
    add_lora(dit, "dit", TARGETS.split(","), 4, 8.0, seed=0)
    load_lora_checkpoint(dit, "dit", path, PREFIXES)
    return dit


def delta(model, module: str):
    """What the adapter adds to a module's weight: scale * B @ A."""
    layer = model.get_submodule(module)
    return (layer.lora_B["default"].weight @ layer.lora_A["default"].weight) * layer.scaling["default"]


def test_the_diffsynth_layout_has_the_models_own_module_names(trained):
    keys = sorted(load_file(str(trained["diffsynth"])))
    assert keys and all(k.startswith("transformer_blocks.") and (".lora_A.default.weight" in k or ".lora_B.default.weight" in k)
                        for k in keys)
    assert sorted(load_file(str(trained["diffusers"]))) == sorted(
        "transformer." + k.replace(".default.", ".") for k in keys)


def test_both_layouts_reproduce_the_in_memory_model(tiny, trained):
    a, b = adapter_from(tiny, trained["diffusers"]), adapter_from(tiny, trained["diffsynth"])
    module = "transformer_blocks.0.attn.to_q"
    assert float(delta(a, module).abs().max()) > 0
    for name in ("transformer_blocks.0.attn.to_q", "transformer_blocks.1.attn.to_out.0"):
        assert torch.allclose(delta(a, name), delta(b, name), atol=1e-6)


@pytest.mark.skipif(not DIFFSYNTH_LOADER.is_file(), reason="the diffsynth wheel is not unpacked (scripts/setup.sh does it)")
def test_diffsynths_own_loader_fuses_the_diffsynth_layout(tiny, trained):
    spec = importlib.util.spec_from_file_location("diffsynth_lora_general", DIFFSYNTH_LOADER)
    general = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(general)
    base = load_components(["dit"], model_paths=str(tiny))["dit"]
    fused = load_components(["dit"], model_paths=str(tiny))["dit"]
    general.GeneralLoRALoader().fuse_lora_to_base_model(fused, load_file(str(trained["diffsynth"])))
    ours = adapter_from(tiny, trained["diffusers"])
    changed = 0
    for name in ("transformer_blocks.0.attn.to_q", "transformer_blocks.0.attn.to_v", "transformer_blocks.1.attn.to_out.0"):
        want = base.get_submodule(name).weight + delta(ours, name)
        got = fused.get_submodule(name).weight
        assert torch.allclose(got, want, atol=1e-6), name
        changed += int(not torch.equal(got, base.get_submodule(name).weight))
    assert changed == 3


def test_lora_convert_turns_one_layout_into_the_other(tiny, trained, tmp_path, capsys):
    from unitgraph.cli.app import main

    def cli(*argv):
        capsys.readouterr()
        with pytest.raises(SystemExit) as exc:
            main(list(argv))
        return int(exc.value.code or 0), *capsys.readouterr()

    code, out, err = cli("lora", "convert", str(trained["diffusers"]), str(tmp_path / "ds.safetensors"), "--to", "diffsynth",
                         "--remove_prefix_in_ckpt", "pipe.dit.")
    assert code == 0, err and "from the diffusers to the diffsynth layout" in out
    converted, written = load_file(str(tmp_path / "ds.safetensors")), load_file(str(trained["diffsynth"]))
    assert set(converted) == set(written) and all(torch.allclose(converted[k], written[k], atol=1e-7) for k in written)
    code, out, err = cli("lora", "convert", str(trained["diffsynth"]), str(tmp_path / "df.safetensors"), "--to", "diffusers")
    assert code == 0, err
    back = adapter_from(tiny, tmp_path / "df.safetensors")
    ours = adapter_from(tiny, trained["diffusers"])
    assert torch.allclose(delta(back, "transformer_blocks.0.attn.to_k"), delta(ours, "transformer_blocks.0.attn.to_k"), atol=1e-6)
    # the converted diffusers file loads in diffusers and fuses to the same weights
    pipe = diffusers.QwenImagePipeline.from_pretrained(str(tiny))
    base = pipe.transformer.transformer_blocks[0].attn.to_k.weight.detach().clone()
    pipe.load_lora_weights(str(tmp_path / "df.safetensors"))
    pipe.fuse_lora()
    fused = pipe.transformer.transformer_blocks[0].attn.to_k.weight
    assert torch.allclose(fused - base, delta(ours, "transformer_blocks.0.attn.to_k"), atol=1e-6)
    # the original is never overwritten; bad requests are one line
    code, _, err = cli("lora", "convert", str(trained["diffusers"]), str(trained["diffusers"]))
    assert code == 2 and "OUT is IN" in err and err.count("\n") == 1
    code, _, err = cli("lora", "convert", str(trained["diffusers"]), str(tmp_path / "x.safetensors"), "--model", "unet")
    assert code == 2 and "--model 'unet' is not a model" in err


def test_flags_that_do_nothing_here_say_so_once(tiny, tmp_path):
    data = tmp_path / "data"
    write_synthetic_dataset(data, count=2, size=SIZE, seed=1)
    lines: list[str] = []
    common = dict(dataset_base_path=str(data), dataset_metadata_path=str(data / "metadata.csv"), model_paths=str(tiny),
                  lora_base_model="dit", max_pixels=SIZE * SIZE, progress=False, plot=False)
    run(make_args(task="sft:data_process", output_path=str(tmp_path / "c"), offload_models="vae,text_encoder",
                  num_epochs=5, dataset_repeat=2, dataset_num_workers=64, **common), echo=lines.append)
    notes = [line for line in lines if line.startswith("note:") and "computing in fp32" not in line]  # this CPU's
    assert any("--offload_models is not needed" in n and "stage 2: dit" in n for n in notes), notes
    assert any("--num_epochs, --dataset_repeat" in n and "stage 1 computes each entry once" in n for n in notes), notes
    assert any("--dataset_num_workers 64 capped at" in n for n in notes), notes
    assert len(notes) == len(set(notes)) == 3
    lines.clear()
    run(make_args(task="sft", output_path=str(tmp_path / "t"), remove_prefix_in_ckpt="pipe.dit.", num_epochs=1,
                  **common), echo=lines.append)
    assert [line for line in lines if "--remove_prefix_in_ckpt pipe.dit.: no key starts with it" in line]
    assert QWEN.slot("dit").lora_prefix == "transformer"


def test_a_launch_that_started_one_of_several_processes_is_warned(monkeypatch):
    from types import SimpleNamespace

    from unitgraph.backends.diffusion.config import RunConfig
    from unitgraph.backends.diffusion.session import plan_for
    from unitgraph.backends.diffusion.stages import flag_notes

    cfg = RunConfig.from_args(make_args(lora_base_model="dit", processor_path="somewhere"))
    plan = plan_for(cfg)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")  # what `accelerate launch --num_processes 2` sets without --multi_gpu
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    notes = flag_notes(cfg, plan, SimpleNamespace(num_processes=1))
    assert any(n.startswith("warning: accelerate launch asked for several processes but started one") for n in notes)
    assert any("--processor_path is not used" in n for n in notes)
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert not any("several processes" in n for n in flag_notes(cfg, plan, SimpleNamespace(num_processes=2)))


def test_a_full_checkpoint_with_diffsynths_prefix_has_the_names_diffsynths_dit_loads(tiny, tmp_path):
    """DiffSynth's full-training command writes `--remove_prefix_in_ckpt "pipe.dit."`, and its validate_full script
    loads the file with `pipe.dit.load_state_dict`: in the diffusers layout the flag strips the DiT's `transformer.`,
    so the keys are those of DiffSynth's own QwenImageDiT (the wheel's class, built on the meta device at the tiny
    model's depth; its widths are fixed at the release's, so names are compared, not shapes)."""
    import json
    import sys
    import types

    dit_file = REPO / ".venv" / "diffsynth-wheel" / "diffsynth" / "models" / "qwen_image_dit.py"
    if not dit_file.is_file():
        pytest.skip("the diffsynth wheel is not unpacked (scripts/setup.sh)")
    pytest.importorskip("einops")
    data = tmp_path / "data"
    write_synthetic_dataset(data, count=1, size=SIZE, seed=4)
    result = run(make_args(task="sft", output_path=str(tmp_path / "full"), dataset_base_path=str(data),
                           dataset_metadata_path=str(data / "metadata.csv"), model_paths=str(tiny), trainable_models="dit",
                           remove_prefix_in_ckpt="pipe.dit.", max_pixels=SIZE * SIZE, progress=False, plot=False),
                 echo=lambda _t: None)
    ours = load_file(str(result.last_checkpoint))
    package = types.ModuleType("diffsynth_models_wheel")
    package.__path__ = [str(dit_file.parent)]
    before = set(sys.modules)
    try:
        sys.modules[package.__name__] = package
        for name in ("general_modules", "qwen_image_dit"):
            spec = importlib.util.spec_from_file_location(f"{package.__name__}.{name}", dit_file.parent / f"{name}.py")
            module = importlib.util.module_from_spec(spec)
            sys.modules[spec.name] = module
            spec.loader.exec_module(module)
        layers = json.loads((tiny / "transformer" / "config.json").read_text())["num_layers"]
        with torch.device("meta"):
            theirs = module.QwenImageDiT(num_layers=layers).state_dict()
    finally:
        for name in [n for n in sys.modules if n.startswith(package.__name__) and n not in before]:
            del sys.modules[name]
    assert not any(k.startswith("transformer.") for k in ours)
    assert set(ours) == set(theirs)
