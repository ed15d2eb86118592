"""DiffSynth-Studio's documented Qwen-Image split-training commands, verbatim but for the program name.

From examples/qwen_image/model_training/special/split_training/Qwen-Image-LoRA.sh: `accelerate launch
examples/qwen_image/model_training/train.py` becomes `unitgraph train`; the tiny models sit where
DiffSynth keeps downloaded models (./models/<org>/<name>/...), the data where its example dataset goes;
only the sizes are lowered (--dataset_repeat, epochs stay 5). No unitgraph-specific variable is set:
the models must be found locally, offline. Then what a DiffSynth user checks: epoch checkpoints named
as DiffSynth names them, loadable by diffusers, and with --lora_format diffsynth by DiffSynth's loader.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
diffusers = pytest.importorskip("diffusers")

from safetensors.torch import load_file  # noqa: E402

from unitgraph.backends.diffusion.data.dataset import write_synthetic_dataset  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
DIFFSYNTH_LOADER = REPO / ".venv" / "diffsynth-wheel" / "diffsynth" / "utils" / "lora" / "general.py"

STAGE1 = """
  --dataset_base_path data/diffsynth_example_dataset/qwen_image/Qwen-Image
  --dataset_metadata_path data/diffsynth_example_dataset/qwen_image/Qwen-Image/metadata.csv
  --max_pixels 1048576
  --dataset_repeat 1
  --model_id_with_origin_paths "Qwen/Qwen-Image:text_encoder/model*.safetensors,Qwen/Qwen-Image:vae/diffusion_pytorch_model.safetensors"
  --learning_rate 1e-4
  --num_epochs 5
  --remove_prefix_in_ckpt "pipe.dit."
  --output_path "./models/train/Qwen-Image-LoRA-splited-cache"
  --lora_base_model "dit"
  --lora_target_modules "to_q,to_k,to_v,add_q_proj,add_k_proj,add_v_proj,to_out.0,to_add_out,img_mlp.net.2,img_mod.1,txt_mlp.net.2,txt_mod.1"
  --lora_rank 32
  --use_gradient_checkpointing
  --dataset_num_workers 8
  --find_unused_parameters
  --task "sft:data_process"
"""
STAGE2 = """
  --dataset_base_path "./models/train/Qwen-Image-LoRA-splited-cache"
  --max_pixels 1048576
  --dataset_repeat 2
  --model_id_with_origin_paths "Qwen/Qwen-Image:transformer/diffusion_pytorch_model*.safetensors"
  --learning_rate 1e-4
  --num_epochs 5
  --remove_prefix_in_ckpt "pipe.dit."
  --output_path "./models/train/Qwen-Image-LoRA-splited"
  --lora_base_model "dit"
  --lora_target_modules "to_q,to_k,to_v,add_q_proj,add_k_proj,add_v_proj,to_out.0,to_add_out,img_mlp.net.2,img_mod.1,txt_mlp.net.2,txt_mod.1"
  --lora_rank 32
  --use_gradient_checkpointing
  --dataset_num_workers 8
  --find_unused_parameters
  --task "sft:train"
"""  # DiffSynth's --dataset_repeat 50 lowered to 2


def unitgraph(shell, cwd: Path, flags: str, *extra: str):
    done = shell.train(cwd, flags, *extra)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


@pytest.fixture(scope="module")
def workdir(tiny, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("diffsynth-user")
    shutil.copytree(tiny, root / "models" / "Qwen" / "Qwen-Image")  # where DiffSynth keeps Qwen/Qwen-Image
    write_synthetic_dataset(root / "data" / "diffsynth_example_dataset" / "qwen_image" / "Qwen-Image", count=3, size=64,
                            seed=8)
    return root


@pytest.mark.slow
def test_diffsynths_split_commands_port_by_swapping_the_program_name(workdir, user_shell):
    first = unitgraph(user_shell, workdir, STAGE1)
    assert "note: --dataset_num_workers 8 capped" in first.stdout or os.cpu_count() >= 8
    assert "--num_epochs" in first.stdout and "stage 1 computes each entry once" in first.stdout
    second = unitgraph(user_shell, workdir, STAGE2)
    out = workdir / "models" / "train" / "Qwen-Image-LoRA-splited"
    assert sorted(p.name for p in out.glob("epoch-*.safetensors")) == [f"epoch-{k}.safetensors" for k in range(5)]
    assert "--remove_prefix_in_ckpt pipe.dit.: no key starts with it" in second.stdout
    # diffusers loads the default layout from the folder DiffSynth's layout holds
    pipe = diffusers.QwenImagePipeline.from_pretrained(str(workdir / "models" / "Qwen" / "Qwen-Image"))
    before = pipe.transformer.transformer_blocks[0].attn.to_q.weight.detach().clone()
    pipe.load_lora_weights(str(out / "epoch-4.safetensors"))
    pipe.fuse_lora()
    assert not torch.equal(pipe.transformer.transformer_blocks[0].attn.to_q.weight, before)


@pytest.mark.slow
@pytest.mark.skipif(not DIFFSYNTH_LOADER.is_file(), reason="the diffsynth wheel is not unpacked (scripts/setup.sh does it)")
def test_with_the_diffsynth_layout_diffsynths_loader_fuses_the_checkpoint(workdir, user_shell):
    unitgraph(user_shell, workdir, STAGE1)
    flags = STAGE2.replace("Qwen-Image-LoRA-splited\"", "Qwen-Image-LoRA-splited-ds\"")
    unitgraph(user_shell, workdir, flags, "--lora_format", "diffsynth")
    ckpt = workdir / "models" / "train" / "Qwen-Image-LoRA-splited-ds" / "epoch-4.safetensors"
    state = load_file(str(ckpt))
    assert state and all(k.startswith("transformer_blocks.") for k in state)
    spec = importlib.util.spec_from_file_location("diffsynth_lora_general", DIFFSYNTH_LOADER)
    general = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(general)
    dit = diffusers.QwenImageTransformer2DModel.from_pretrained(str(workdir / "models" / "Qwen" / "Qwen-Image"),
                                                               subfolder="transformer")
    before = dit.transformer_blocks[0].attn.to_q.weight.detach().clone()
    general.GeneralLoRALoader().fuse_lora_to_base_model(dit, state)
    assert not torch.equal(dit.transformer_blocks[0].attn.to_q.weight, before)


def test_model_ids_resolve_as_diffsynth_resolves_them(tmp_path):
    from unitgraph.backends.diffusion.models.hub import OFFLINE_VARIABLES, Hub
    from unitgraph.backends.diffusion.models.folders import ModelLoadError

    for name in OFFLINE_VARIABLES:
        hub = Hub.from_env(environ={name: "True"})
        assert hub.offline and hub.offline_reason == name
    assert not Hub.from_env(environ={"DIFFSYNTH_SKIP_DOWNLOAD": "False"}).offline
    base = tmp_path / "elsewhere"
    (base / "acme" / "tiny" / "vae").mkdir(parents=True)
    (base / "acme" / "tiny" / "vae" / "diffusion_pytorch_model.safetensors").write_bytes(b"x")
    hub = Hub.from_env(environ={"DIFFSYNTH_MODEL_BASE_PATH": str(base), "DIFFSYNTH_SKIP_DOWNLOAD": "1"},
                       cache_dir=str(tmp_path / "ms"))
    assert hub.snapshot("acme/tiny", "vae/diffusion_pytorch_model.safetensors", ModelLoadError) == base / "acme" / "tiny" / "vae"
    assert hub.local("acme/tiny", "vae/model*.safetensors") is None  # the pattern must match a file
    with pytest.raises(ModelLoadError) as exc:
        hub.snapshot("acme/other", "text_encoder/model*.safetensors", ModelLoadError)
    line = str(exc.value)
    assert "\n" not in line and str(base / "acme" / "other") in line and "DIFFSYNTH_MODEL_BASE_PATH" in line
    assert "offline: DIFFSYNTH_SKIP_DOWNLOAD" in line and "--model_paths" in line and str(tmp_path / "ms") in line


def test_with_no_network_a_missing_model_fails_at_once_in_one_line(tmp_path, monkeypatch):
    """Online, but modelscope's endpoint refuses connections: the cache is read, the download (and its retries,
    about 25 s a model id) is never tried, and the line says there is no network."""
    import socket
    import time

    import modelscope

    from unitgraph.backends.diffusion.models import hub as hub_module
    from unitgraph.backends.diffusion.models.folders import ModelLoadError

    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    for name in hub_module.PROXY_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("MODELSCOPE_DOMAIN", f"127.0.0.1:{port}")  # modelscope adds https://
    hub_module._unreachable.cache_clear()
    calls = []

    def snapshot_download(model_id, cache_dir=None, allow_patterns=None, local_files_only=False):
        calls.append((model_id, local_files_only))
        if local_files_only:
            raise ValueError("not in the cache")
        time.sleep(30)  # what modelscope's retries would cost

    monkeypatch.setattr(modelscope, "snapshot_download", snapshot_download)
    hub = hub_module.Hub(base_path=tmp_path / "models", cache_dir=str(tmp_path / "ms"))
    started = time.monotonic()
    with pytest.raises(ModelLoadError) as exc:
        hub.snapshot("acme/tiny", "transformer/diffusion_pytorch_model*.safetensors", ModelLoadError)
    assert time.monotonic() - started < hub_module.PROBE_SECONDS + 2
    line = str(exc.value)
    assert "\n" not in line and "acme/tiny" in line and "no network" in line and f"127.0.0.1:{port}" in line
    assert str(tmp_path / "models" / "acme" / "tiny" / "transformer") in line and "--model_paths" in line
    assert calls == [("acme/tiny", True)]  # the cache was asked, the network never
    hub_module._unreachable.cache_clear()


def test_every_local_copy_is_tried_before_any_download(tiny, tmp_path, monkeypatch):
    """DiffSynth's edit commands name the DiT's and the encoders' model ids, and the processor defaults to another
    (Qwen/Qwen-Image-Edit:processor/): the local copy of the processor is found before any model id is looked for
    online (each failed download costs modelscope's retries)."""
    import shutil

    import modelscope

    from unitgraph.backends.diffusion.families.qwen_image import FAMILY
    from unitgraph.backends.diffusion.models.hub import Hub
    from unitgraph.backends.diffusion.models.sources import ModelSources

    base = tmp_path / "models"
    for model_id, subs in (("Qwen/Qwen-Image", ("text_encoder", "vae", "tokenizer")),
                           ("Qwen/Qwen-Image-Edit-2509", ("transformer",))):
        for sub in subs:
            shutil.copytree(tiny / sub, base / model_id / sub)
    processor = base / "Qwen" / "Qwen-Image-Edit" / "processor"  # resolving reads its config only
    processor.mkdir(parents=True)
    (processor / "preprocessor_config.json").write_text('{"processor_class": "Qwen2VLProcessor"}')
    calls = []

    def snapshot_download(model_id, cache_dir=None, allow_patterns=None, local_files_only=False):
        calls.append((model_id, local_files_only))
        raise ValueError("not in the cache" if local_files_only else "no network")

    monkeypatch.setattr(modelscope, "snapshot_download", snapshot_download)
    ids = ("Qwen/Qwen-Image-Edit-2509:transformer/diffusion_pytorch_model*.safetensors,"
           "Qwen/Qwen-Image:text_encoder/model*.safetensors,Qwen/Qwen-Image:vae/diffusion_pytorch_model.safetensors")
    sources = ModelSources(FAMILY, model_id_with_origin_paths=ids, hub=Hub(base_path=base))
    assert sources.resolve("processor").path == base / "Qwen" / "Qwen-Image-Edit" / "processor"
    assert all(local for _, local in calls), calls  # the cache was asked, the network never
