"""DiffSynth-Studio's own pipelines trained through unitgraph (`--pipeline diffsynth:MODULE`, diffsynth_source/).

These tests need the `diffsynth` package itself, which needs torchvision: they run in the second environment
`scripts/test_diffsynth.sh` makes (.venv-diffsynth: torch 2.14.1 + torchvision 0.29.1 + diffsynth 2.1.12) and are
skipped elsewhere. The models are test-sized, written in DiffSynth's `./models` layout (diffsynth_source/tiny.py),
and loaded by DiffSynth's own loader; a command names them as DiffSynth's example does, by model id and pattern.

What they show, per pipeline:
- unitgraph's unsplit step equals DiffSynth's own training step (its loader, its `DiffusionTrainingModule` glue as the
  example's train.py assembles it, its dataset operators and its loss): the loss and every LoRA gradient bit for bit
  at fp32;
- split == unsplit (losses and the LoRA file, bit for bit), with stage 2 run after the text encoder's file is gone;
- the checkpoint loads with DiffSynth's `pipe.load_lora` and changes the model it is loaded into;
- what a unit does beyond its declaration stops stage 1 in one line naming it.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

diffsynth = pytest.importorskip("diffsynth", reason="DiffSynth-Studio is not installed (scripts/test_diffsynth.sh)")

import torch  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from unitgraph.backends.diffusion.args import make_args  # noqa: E402
from unitgraph.backends.diffusion.data.dataset import write_synthetic_dataset  # noqa: E402
from unitgraph.backends.diffusion.diffsynth_source import run as ds_run  # noqa: E402
from unitgraph.backends.diffusion.diffsynth_source.run import run  # noqa: E402
from unitgraph.backends.diffusion.diffsynth_source.tiny import write_tiny_models  # noqa: E402
from unitgraph.backends.diffusion.errors import BackendError  # noqa: E402
from unitgraph.backends.diffusion.randomness import seeded_global_stream  # noqa: E402

pytestmark = pytest.mark.diffsynth

MODULE = "stable_diffusion"
TARGETS = "to_q,to_k,to_v,to_out.0"


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """The tiny ./models of DiffSynth's SD 1.5 example, a 3-image dataset, and the environment DiffSynth reads."""
    root = tmp_path_factory.mktemp("diffsynth_sd")
    flags = write_tiny_models(root / "models", MODULE)
    write_synthetic_dataset(root / "data", count=3, size=40)
    saved = {k: os.environ.get(k) for k in ("DIFFSYNTH_MODEL_BASE_PATH", "DIFFSYNTH_SKIP_DOWNLOAD")}
    os.environ["DIFFSYNTH_MODEL_BASE_PATH"] = str(root / "models")
    os.environ["DIFFSYNTH_SKIP_DOWNLOAD"] = "True"
    yield root, flags
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def _args(root: Path, flags: dict, **over):
    base = dict(pipeline=f"diffsynth:{MODULE}", dataset_base_path=str(root / "data"),
                dataset_metadata_path=str(root / "data" / "metadata.csv"), height=32, width=32,
                model_id_with_origin_paths=flags["model_id_with_origin_paths"], lora_base_model="unet",
                lora_target_modules=TARGETS, lora_rank=4, remove_prefix_in_ckpt="pipe.unet.", num_epochs=2, seed=3)
    base.update(over)
    return make_args(**base)


def test_the_unsplit_step_is_diffsynths_own_training_step(world):
    """One step of `unitgraph train --pipeline diffsynth:stable_diffusion` against DiffSynth's: the example's
    train.py glue written out here with DiffSynth's classes (from_pretrained, split_pipeline_units,
    switch_pipe_to_training_mode, UnifiedDataset with its ImageCropAndResize, unit_runner, FlowMatchSFTLoss)."""
    from diffsynth.core import ModelConfig, UnifiedDataset
    from diffsynth.diffusion.loss import FlowMatchSFTLoss
    from diffsynth.diffusion.training_module import DiffusionTrainingModule
    from diffsynth.pipelines.stable_diffusion import StableDiffusionPipeline

    root, flags = world
    args = _args(root, flags)
    setup = ds_run.setup(args)  # recognises the tiny files (registers them in DiffSynth's table for this process)
    pipe = setup.load(sorted(set(setup.plan.data_process_models) | set(setup.plan.train_models)), "the run")
    ds_run._lora(setup, pipe)
    dataset = ds_run.dataset_of(setup)
    ours_state = ds_run.run_units(pipe, setup.stage_units("data_process"),
                                  ds_run._transfer(ds_run.sample_state(setup, dataset, 1, pipe.device), pipe))
    seed = ds_run.step_seed(args.seed, 0, dataset.sample_id(1))
    ours = ds_run.train_step(pipe, setup.stage_units("train"), ours_state, seed)
    ours.backward()
    ours_grads = {n: p.grad.clone() for n, p in pipe.unet.named_parameters() if p.requires_grad}

    # DiffSynth's own: its loader on the same files, its training module, its dataset, its loss
    base = root / "models"
    configs = [ModelConfig(path=str(base / item.split(":")[0] / item.split(":")[1]))
               for item in flags["model_id_with_origin_paths"].split(",")]
    module = DiffusionTrainingModule()
    module.pipe = StableDiffusionPipeline.from_pretrained(torch_dtype=torch.float32, device="cpu", model_configs=configs,
                                                          tokenizer_config=ModelConfig(path=flags["tokenizer_path"]))
    module.pipe = module.split_pipeline_units("sft", module.pipe, None, "unet")
    with seeded_global_stream(args.seed, "diffsynth-lora-init"):  # unitgraph's LoRA initialisation stream
        module.switch_pipe_to_training_mode(module.pipe, None, "unet", TARGETS, 4, None, None, None, task="sft")
    data = UnifiedDataset(base_path=str(root / "data"), metadata_path=str(root / "data" / "metadata.csv"), repeat=1,
                          data_file_keys=["image"],
                          main_data_operator=UnifiedDataset.default_image_operator(
                              base_path=str(root / "data"), max_pixels=args.max_pixels, height=32, width=32,
                              height_division_factor=32, width_division_factor=32))[1]
    pipe2 = module.pipe
    inputs = ({"input_image": data["image"], "height": data["image"].size[1], "width": data["image"].size[0],
               "cfg_scale": 1, "rand_device": pipe2.device, "use_gradient_checkpointing": False,
               "use_gradient_checkpointing_offload": False}, {"prompt": data["prompt"]}, {"negative_prompt": ""})
    torch.manual_seed(seed)
    inputs = module.transfer_data_to_device(inputs, pipe2.device, pipe2.torch_dtype)
    for unit in pipe2.units:
        inputs = pipe2.unit_runner(unit, pipe2, *inputs)
    theirs = FlowMatchSFTLoss(pipe2, **inputs[0], **inputs[1])
    theirs.backward()
    theirs_grads = {n: p.grad for n, p in pipe2.unet.named_parameters() if p.requires_grad}

    assert ours.item() == theirs.item()
    assert set(ours_grads) == set(theirs_grads) and len(ours_grads) > 0
    for name, grad in ours_grads.items():
        assert torch.equal(grad, theirs_grads[name]), name
    assert any(g.abs().sum() > 0 for g in ours_grads.values())


def test_split_equals_unsplit_and_stage_2_needs_no_text_encoder(world, tmp_path):
    root, flags = world
    unsplit = run(_args(root, flags, output_path=str(tmp_path / "sft")))
    cache = tmp_path / "cache"
    s1 = run(_args(root, flags, task="sft:data_process", output_path=str(cache)))
    assert s1.entries_computed == 3 and (cache / ds_run.MANIFEST).is_file()
    # stage 2 without the text encoder's file on disk, and without naming it
    te = root / "models" / "AI-ModelScope" / "stable-diffusion-v1-5" / "text_encoder"
    hidden = tmp_path / "te"
    shutil.move(str(te), str(hidden))
    try:
        ids = ",".join(p for p in flags["model_id_with_origin_paths"].split(",") if "text_encoder" not in p)
        split = run(_args(root, flags, task="sft:train", dataset_base_path=str(cache), dataset_metadata_path=None,
                          model_id_with_origin_paths=ids, output_path=str(tmp_path / "split")))
    finally:
        shutil.move(str(hidden), str(te))
    assert unsplit.losses == split.losses and len(split.losses) == 6
    a, b = load_file(str(unsplit.last_checkpoint)), load_file(str(split.last_checkpoint))
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
    assert unsplit.last_checkpoint.name == "epoch-1.safetensors"
    # a second stage 1 reuses every entry
    again = run(_args(root, flags, task="sft:data_process", output_path=str(cache)))
    assert again.entries_computed == 0 and again.entries_reused == 3


def test_the_checkpoint_loads_with_diffsynths_load_lora(world, tmp_path):
    root, flags = world
    result = run(_args(root, flags, output_path=str(tmp_path / "out"), num_epochs=1, learning_rate=1e-2))
    lora = load_file(str(result.last_checkpoint))
    assert lora and all(k.endswith(("lora_A.default.weight", "lora_B.default.weight")) for k in lora)
    assert not any(k.startswith("pipe.") for k in lora)
    setup = ds_run.setup(_args(root, flags))
    pipe = setup.load(["unet"], "the check")
    before = {k: v.clone() for k, v in pipe.unet.state_dict().items()}
    pipe.load_lora(pipe.unet, str(result.last_checkpoint))
    changed = [k for k, v in pipe.unet.state_dict().items() if k in before and not torch.equal(v, before[k])]
    assert changed, "DiffSynth's load_lora left the UNet as it was"


def test_a_unit_doing_more_than_it_declares_stops_stage_1(world, tmp_path, monkeypatch):
    from diffsynth.pipelines import stable_diffusion as sd

    root, flags = world
    original = sd.SDUnit_ShapeChecker.process

    def draws(self, pipe, **kwargs):
        torch.rand(1)  # a draw the adapter cannot see in the source it read
        return original(self, pipe, **kwargs)

    monkeypatch.setattr(sd.SDUnit_ShapeChecker, "process", draws)
    with pytest.raises(BackendError, match="unit ShapeChecker draws from torch's random stream"):
        run(_args(root, flags, task="sft:data_process", output_path=str(tmp_path / "c1")))

    def writes(self, pipe, **kwargs):
        out = original(self, pipe, **kwargs)
        return {**out, "surprise": 1}

    monkeypatch.setattr(sd.SDUnit_ShapeChecker, "process", writes)
    with pytest.raises(BackendError, match="unit ShapeChecker writes surprise"):
        run(_args(root, flags, task="sft:data_process", output_path=str(tmp_path / "c2")))

    def calls(self, pipe, **kwargs):
        pipe.unet.in_channels  # a model the unit does not name, which stage 1 does not load
        return original(self, pipe, **kwargs)

    monkeypatch.setattr(sd.SDUnit_ShapeChecker, "process", calls)
    with pytest.raises(BackendError, match="unit ShapeChecker uses the model unet"):
        run(_args(root, flags, task="sft:data_process", output_path=str(tmp_path / "c3")))


def test_bad_commands_are_one_line(world, tmp_path):
    root, flags = world
    with pytest.raises(BackendError, match="--ema_decay is not available yet"):
        run(_args(root, flags, ema_decay=0.9, output_path=str(tmp_path / "x")))
    with pytest.raises(BackendError, match="not trained through DiffSynth's own code yet"):
        run(_args(root, flags, pipeline="diffsynth:ernie_image", output_path=str(tmp_path / "x")))
    with pytest.raises(BackendError, match="matches no module|not found"):
        run(_args(root, flags, lora_target_modules="nope", output_path=str(tmp_path / "x")))
    with pytest.raises(BackendError, match="no cache of stage 1 here"):
        run(_args(root, flags, task="sft:train", dataset_base_path=str(tmp_path), output_path=str(tmp_path / "x")))
