"""DiffSynth-Studio's own pipelines trained through unitgraph (`--pipeline diffsynth:MODULE`, diffsynth_source/).

These tests need the `diffsynth` package itself, which needs torchvision: they run in the second environment
`scripts/test_diffsynth.sh` makes (.venv-diffsynth: torch 2.14.1 + torchvision 0.29.1 + diffsynth 2.1.12) and are
skipped elsewhere. The models are test-sized, written in DiffSynth's `./models` layout (diffsynth_source/tiny.py),
and loaded by DiffSynth's own loader; a command names them as DiffSynth's example does, by model id and pattern.

Pipelines: Stable Diffusion 1.5, SDXL, Z-Image, Wan 2.1 T2V and FLUX.2 [klein] (families unitgraph also trains
itself), Ideogram 4, Anima, ERNIE-Image, Krea 2 (DiffSynth's alone; Anima's classes fix their sizes, so its DiT
is the released 2.09 B, 4.2 GB in bf16, and the text encoder classes of ERNIE-Image and Krea 2 fix Ministral 3's
3.43 B and Qwen3-VL's 4.44 B, 6.9 and 8.9 GB in bf16: only the step, split and checkpoint checks run for them; Krea
2's DiT asks torch for cuDNN's attention kernel alone, which no CPU has, so its tests let torch choose its math
kernel, for DiffSynth's own step and unitgraph's alike: any_attention_kernel), and LingBot-Video (its dense text to
video DiT test-sized, Krea 2's text encoder read through a Qwen3-VL processor). Wan's VAE class fixes its size (127 M
parameters, written in bf16: 254 MB per module). The text encoder class of Z-Image, FLUX.2 [klein] and Anima allows
nothing smaller than Qwen3 0.6B (1.2 GB in bf16, written once a session and linked into each module's folder).
What they show, per pipeline:
- unitgraph's unsplit step equals DiffSynth's own training step (its loader, its `DiffusionTrainingModule` glue as the
  example's train.py assembles it, its dataset operators and its loss): the loss and every LoRA gradient bit for bit
  at fp32;
- split == unsplit (losses and the LoRA file, bit for bit), with stage 2 run after the text encoder's file is gone;
- the checkpoint loads with DiffSynth's `pipe.load_lora` and changes the model it is loaded into;
- a unit reading a model of the other stage (Ideogram 4's prompt unit reads the DiT's patch size) runs in stage 1 on
  that model's skeleton;
- what a unit does beyond its declaration stops stage 1 in one line naming it.
"""

from __future__ import annotations

import gc
import importlib.util
import json
import shutil
from pathlib import Path

import pytest

diffsynth = pytest.importorskip("diffsynth", reason="DiffSynth-Studio is not installed (scripts/test_diffsynth.sh)")

import torch  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from diffsynth_env import add_distill_columns, any_attention_kernel, diffsynth_models  # noqa: E402

from unitgraph.backends.diffusion.args import make_args  # noqa: E402
from unitgraph.backends.diffusion.data.dataset import write_synthetic_dataset  # noqa: E402
from unitgraph.backends.diffusion.diffsynth_source import run as ds_run  # noqa: E402
from unitgraph.backends.diffusion.diffsynth_source.run import run  # noqa: E402
from unitgraph.backends.diffusion.diffsynth_source.tiny import write_tiny_models  # noqa: E402
from unitgraph.backends.diffusion.errors import BackendError  # noqa: E402
from unitgraph.backends.diffusion.randomness import seeded_global_stream  # noqa: E402

pytestmark = pytest.mark.diffsynth

# module -> (LoRA base model, --lora_target_modules as its example names them, --remove_prefix_in_ckpt)
PIPELINES = {
    "stable_diffusion": ("unet", "to_q,to_k,to_v,to_out.0", "pipe.unet."),
    "ideogram4": ("dit", "attention.qkv,attention.o,feed_forward.w1,feed_forward.w2,feed_forward.w3,adaln_modulation",
                  "pipe.dit."),
    "z_image": ("dit", "to_q,to_k,to_v,to_out.0,w1,w2,w3", "pipe.dit."),
    "stable_diffusion_xl": ("unet", "to_q,to_k,to_v,to_out.0", "pipe.unet."),
    "wan_video": ("dit", "q,k,v,o,ffn.0,ffn.2", "pipe.dit."),
    "flux2_image": ("dit", "to_q,to_k,to_v,to_out.0,add_q_proj,add_k_proj,add_v_proj,to_add_out,linear_in,linear_out,"
                           "to_qkv_mlp_proj,single_transformer_blocks.0.attn.to_out", "pipe.dit."),
    # its example's "" (DiffSynth's auto-detection: every Linear at least 512 wide in the DiT's blocks)
    "anima_image": ("dit", "", "pipe.dit."),
    "ernie_image": ("dit", "to_q,to_k,to_v,to_out.0", "pipe.dit."),
    "krea2": ("dit", "wq,wk,wv,gate,wo,gate,up,down,first,tmlp.0,tmlp.2,projector,txtmlp.1,txtmlp.3,last.linear,tproj.1",
              "pipe.dit."),
    "lingbot_video": ("dit", "to_q,to_k,to_v,to_out", "pipe.dit."),
    "mova_audio_video": ("video_dit", "q,k,v,o,ffn.0,ffn.2", "pipe.video_dit."),
    "ace_step": ("dit", "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj", "pipe.dit."),
    "qwen_image": ("dit", "to_q,to_k,to_v,add_q_proj,add_k_proj,add_v_proj,to_out.0,to_add_out,img_mlp.net.2,img_mod.1,"
                          "txt_mlp.net.2,txt_mod.1", "pipe.dit."),
    "boogu_image": ("dit", "to_q,to_k,to_v,to_out.0,img_to_q,img_to_k,img_to_v,img_out,instruct_to_q,instruct_to_k,"
                           "instruct_to_v,instruct_out", "pipe.dit."),
    "joyai_image": ("dit", "img_attn_qkv,txt_attn_qkv,img_attn_proj,txt_attn_proj", "pipe.dit."),
    "hidream_o1_image": ("dit", "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj,attn.qkv,attn.proj,"
                                "mlp.linear_fc1,mlp.linear_fc2", "pipe.dit."),
}
# pipelines whose classes fix a large size (Anima's DiT: 2.09 B parameters, 4.2 GB in bf16; ERNIE-Image's text
# encoder: 3.43 B, 6.9 GB; Krea 2's and LingBot-Video's: 4.44 B, 8.9 GB; Qwen-Image's: 8.29 B, 16.6 GB, and its DiT's
# one block at the released width, 0.38 B; Boogu-Image's and JoyAI-Image's: 8.77 B, 17.5 GB; HiDream-O1's DiT, the
# model it trains: 8.80 B, 17.6 GB): only the checks of the step, the split and
# the checkpoint run for them, not every test the module-wide `world` fixture gives the others; nor for MOVA, whose
# example trains on a clip's sound track, which the other tests' data lacks; nor for ACE-Step, which trains on songs
HEAVY = {"anima_image", "ernie_image", "krea2", "lingbot_video", "mova_audio_video", "ace_step", "qwen_image",
         "boogu_image", "joyai_image", "hidream_o1_image"}
LIGHT = sorted(set(PIPELINES) - HEAVY)
# the inputs an image example's get_pipeline_inputs sets beyond the picture, its size, cfg_scale, rand_device and the
# checkpointing flags (examples/flux2/model_training/train.py: "embedded_guidance": 1.0)
EXAMPLE_INPUTS = {"flux2_image": {"embedded_guidance": 1.0},
                  # examples/hidream_o1_image/model_training/train.py: its --noise_scale's default
                  "hidream_o1_image": {"noise_scale": 8.0}}
# the negative prompts of the image examples' get_pipeline_inputs, where not "" (HiDream-O1's: " ")
EXAMPLE_NEGATIVE = {"hidream_o1_image": " "}
# the inputs a video example's get_pipeline_inputs sets beyond the clip, its size and frame count, cfg_scale,
# rand_device, the checkpointing flags and the timestep boundaries
EXAMPLE_VIDEO_INPUTS = {
    # examples/wanvideo/model_training/train.py (it forces gradient checkpointing on)
    "wan_video": {"tiled": False, "use_gradient_checkpointing": True, "cfg_merge": False, "vace_scale": 1},
    "lingbot_video": {"seed": None},  # examples/lingbot_video/model_training/train.py
    # examples/mova/model_training/train.py (data.get("frame_rate", 24): the metadata has no such column)
    "mova_audio_video": {"frame_rate": 24, "tiled": False},
}
# the losses an example's task_to_loss maps sft to, where not FlowMatchSFTLoss
EXAMPLE_SFT_LOSS = {"mova_audio_video": "FlowMatchSFTAudioVideoLoss"}


def _sound(module: str) -> bool:
    from unitgraph.backends.diffusion.diffsynth_source.glue import glue_for

    return bool(glue_for(module).audio)


def _song(module: str) -> bool:
    from unitgraph.backends.diffusion.diffsynth_source.glue import glue_for

    return glue_for(module).media == "audio"


def song_metadata(folder: Path) -> Path:
    """The synthetic songs' metadata.csv as the metadata.json ACE-Step's example dataset has (an empty cell: no key,
    which its get_pipeline_inputs reads as its default; DiffSynth's pandas would read a csv's empty bpm as NaN)."""
    import csv

    with (folder / "metadata.csv").open(newline="", encoding="utf-8") as handle:
        rows = [{k: (int(v) if k == "bpm" else v) for k, v in row.items() if v != "" or k == "lyrics"}
                for row in csv.DictReader(handle)]
    (folder / "metadata.json").write_text(json.dumps(rows, indent=1), encoding="utf-8")
    return folder / "metadata.json"


def _edit(module: str) -> bool:
    """Whether the pipeline trains edits only (JoyAI-Image): its data has an edit_image column, its commands hand it."""
    from unitgraph.backends.diffusion.diffsynth_source.glue import glue_for

    return glue_for(module).edits


def _video(module: str) -> bool:
    from unitgraph.backends.diffusion.diffsynth_source.glue import glue_for

    return glue_for(module).media == "video"


@pytest.fixture(scope="module", params=LIGHT)
def world(request, tmp_path_factory):
    """The tiny ./models of the pipeline's DiffSynth example, a 3-image dataset, and the environment DiffSynth reads."""
    module = request.param
    root = tmp_path_factory.mktemp(f"diffsynth_{module}")
    flags = dict(write_tiny_models(root / "models", module), module=module)
    if _video(module):  # 5-frame clips (a 40 px image scrolling sideways) in a `video` column (with a tone: MOVA's)
        write_synthetic_dataset(root / "data", count=3, size=40, videos=("video",), frames=5, audio=_sound(module))
    elif _song(module):  # 1.3 s songs (a tone; one mono) with lyrics (one empty), as ACE-Step's metadata.json has them
        write_synthetic_dataset(root / "data", count=3, size=40, songs=1.3)
        song_metadata(root / "data")
    else:  # (an edit pipeline's: a picture to edit beside each target, its mirror image)
        write_synthetic_dataset(root / "data", count=3, size=40, edit=_edit(module))
    with diffsynth_models(root / "models"), any_attention_kernel(module):  # Krea 2's DiT: cuDNN's kernel alone
        yield root, flags
    shutil.rmtree(root, ignore_errors=True)  # (disk: see models_removed_after)


@pytest.fixture(autouse=True)
def models_removed_after(tmp_path):
    """A test's `./models` removed when it ends, as each `world` is when its pipeline's tests end. The released-size
    files (Boogu-Image's text encoder alone is 17.5 GB) are written once a session and linked into every further
    folder (tiny._once); pytest removes a passed test's folder as it ends, but keeps a failed test's, and a module's
    fixture folders, until the session ends: kept, the set would hold every pipeline's at once (about 57 GB).
    Removed, a later test writes its pipeline's again (a minute or so), and the disk holds about one pipeline's at a
    time."""
    yield
    shutil.rmtree(tmp_path / "models", ignore_errors=True)


def _args(root: Path, flags: dict, **over):
    base_model, targets, prefix = PIPELINES[flags["module"]]
    base = dict(pipeline=f"diffsynth:{flags['module']}", dataset_base_path=str(root / "data"),
                dataset_metadata_path=str(root / "data" / "metadata.csv"), height=32, width=32,
                model_id_with_origin_paths=flags["model_id_with_origin_paths"], lora_base_model=base_model,
                lora_target_modules=targets, lora_rank=4, remove_prefix_in_ckpt=prefix, num_epochs=2, seed=3)
    if _video(flags["module"]):
        base.update(num_frames=5, data_file_keys="video")
    if _sound(flags["module"]):  # as MOVA's LoRA example hands the clip's sound and first frame to the pipeline
        base.update(data_file_keys="video,input_audio", extra_inputs="input_audio,input_image")
    if _song(flags["module"]):  # ACE-Step's example: songs, no picture size; its tokenizer and silence latent named
        base.update(data_file_keys="audio", height=None, width=None, tokenizer_path=flags["tokenizer_path"],
                    silence_latent_path=flags["silence_latent_path"],
                    dataset_metadata_path=str(root / "data" / "metadata.json"))
    if _edit(flags["module"]):  # as JoyAI-Image's example hands the picture it edits
        base.update(data_file_keys="image,edit_image", extra_inputs="edit_image")
    from unitgraph.backends.diffusion.diffsynth_source.glue import glue_for

    glue = glue_for(flags["module"])
    if (32 // glue.division) ** 2 < glue.min_cells:  # HiDream-O1: 2x2 patches of 32 px (not its fewest, one)
        base.update(height=2 * glue.division, width=2 * glue.division)
    if flags["module"] == "flux2_image":  # its train.py defaults to FLUX.2-dev's tokenizer; klein's example names its own
        base.update(tokenizer_path=flags["tokenizer_path"])
    base.update(over)
    return make_args(**base)


def diffsynths_step(module, inputs: tuple, seed: int, base_model: str, task: str = "sft", sft: str = "FlowMatchSFTLoss"):
    """DiffSynth's own training step on `inputs` (shared, positive, negative), as its training module runs it: the
    data to the pipeline's device and dtype, torch's stream seeded, every unit through its runner, the task's loss as
    the example's task_to_loss maps it (`sft`: FlowMatchSFTLoss, MOVA's FlowMatchSFTAudioVideoLoss; DirectDistillLoss),
    backward. Returns the loss and the gradients of `base_model`'s trained parameters."""
    from diffsynth.diffusion import loss as losses

    pipe = module.pipe
    inputs = module.transfer_data_to_device(inputs, pipe.device, pipe.torch_dtype)
    torch.manual_seed(seed)
    for unit in pipe.units:
        inputs = pipe.unit_runner(unit, pipe, *inputs)
    loss = {"sft": getattr(losses, sft), "direct_distill": losses.DirectDistillLoss}[task](pipe, **inputs[0], **inputs[1])
    loss.backward()
    return loss, {n: p.grad for n, p in getattr(pipe, base_model).named_parameters() if p.requires_grad}


def our_unsplit_step(setup, args, base_model: str):
    """unitgraph's unsplit step on the dataset's second sample: (its loss, the gradients of `base_model`'s trained
    parameters, the sample's step seed)."""
    pipe = setup.load(sorted(set(setup.plan.data_process_models) | set(setup.plan.train_models)), "the run")
    ds_run._lora(setup, pipe)
    dataset = ds_run.dataset_of(setup)
    state = ds_run.run_units(pipe, setup.stage_units("data_process"),
                             ds_run._transfer(ds_run.sample_state(setup, dataset, 1, pipe.device), pipe))
    seed = ds_run.step_seed(args.seed, 0, dataset.sample_id(1))
    loss = ds_run.train_step(pipe, setup.stage_units("train"), state, seed, args.task, ds_run.step_loss(args))
    loss.backward()
    grads = {n: None if p.grad is None else p.grad.clone() for n, p in getattr(pipe, base_model).named_parameters()
             if p.requires_grad}
    return loss.detach(), grads, seed  # (nothing of the pipeline kept: a caller may load DiffSynth's own next)


def diffsynths_module(setup, configs, base_model: str, targets: str, seed: int):
    """DiffSynth's training module as the example's train.py assembles it on `configs` (from_pretrained,
    split_pipeline_units, switch_pipe_to_training_mode), the LoRA drawn from unitgraph's initialisation stream."""
    from diffsynth.core import ModelConfig
    from diffsynth.diffusion.training_module import DiffusionTrainingModule

    glue = setup.glue
    module = DiffusionTrainingModule()
    files = {k: ModelConfig(path=v) for k, v in setup.tokenizers_for([t.encoder for t in glue.tokenizers]).items()}
    for tensor in glue.tensors:  # the release's .pt (a pickle, which DiffSynth's from_pretrained reads) of the twin
        files[tensor.keyword] = ModelConfig(path=str(released_pt(setup, tensor)))
    module.pipe = setup.pipe_class.from_pretrained(torch_dtype=getattr(torch, glue.dtype), device="cpu",
                                                   model_configs=configs, **files)
    module.pipe = module.split_pipeline_units("sft", module.pipe, None, base_model)
    with seeded_global_stream(seed, "diffsynth-lora-init"):  # unitgraph's LoRA initialisation stream
        module.switch_pipe_to_training_mode(module.pipe, None, base_model, targets, 4, None, None, None, task="sft")
    return module


def released_pt(setup, tensor) -> Path:
    """The `.pt` file a release keeps `tensor` in (what DiffSynth's from_pretrained unpickles), written here with
    torch.save from unitgraph's safetensors twin beside it, as the release has it."""
    from unitgraph.backends.diffusion.diffsynth_source.models import tensor_file

    twin = tensor_file(tensor, getattr(setup.args, tensor.flag, None), setup.hub)
    pt = twin.with_suffix(".pt")
    if not pt.is_file():
        (value,) = load_file(str(twin)).values()
        torch.save(value, str(pt))
    return pt


def example_inputs(root: Path, flags: dict, args, glue, device, module=None, index: int = 1) -> tuple:
    """The second sample (or row `index`) as the example's UnifiedDataset reads it (its image or video operator; the data folder and
    metadata of `args`), as the inputs its get_pipeline_inputs makes of it (shared, positive, negative), the
    --extra_inputs columns added by the training `module`'s parse_extra_inputs."""
    from diffsynth.core import UnifiedDataset

    base, metadata = str(args.dataset_base_path), str(args.dataset_metadata_path)
    made = _example_inputs(base, metadata, flags, args, glue, device, index)
    if args.extra_inputs and _sound(flags["module"]):  # MOVA's parse_extra_inputs, on its dataset's sample
        data = _sound_data(base, metadata, index)
        for name in args.extra_inputs.split(","):
            made[0][name] = data["video"][0] if name == "input_image" else data[name]
    elif args.extra_inputs:  # (a picture column it hands on: through the example's image operator, as read)
        extra = args.extra_inputs.split(",")
        files = [k for k in (args.data_file_keys or "").split(",") if k in extra]
        read = dict(main_data_operator=UnifiedDataset.default_image_operator(
            base_path=base, max_pixels=args.max_pixels, height=args.height, width=args.width,
            height_division_factor=glue.division, width_division_factor=glue.division)) if files else {}
        data = UnifiedDataset(base_path=base, metadata_path=metadata, repeat=1, data_file_keys=files, **read)[index]
        module.parse_extra_inputs(data, args.extra_inputs.split(","), made[0])
    return made


def pyav_load(path: str) -> tuple:
    """torchaudio.load's (float32 (channels, samples) tensor, rate) of a file's whole sound track, read with PyAV's
    bundled decoder (torchaudio 2.11 reads through torchcodec, which needs a system FFmpeg, absent here)."""
    from unitgraph.backends.diffusion.data.audio import read_audio

    samples, rate = read_audio(Path(path))
    return torch.from_numpy(samples), rate


def _sound_data(base: str, metadata: str, index: int) -> dict:
    """Row `index` as MOVA's example's UnifiedDataset reads it: its clip by the video operator at 24 fps
    (fix_frame_rate), its sound by LoadAudioWithTorchaudio (the clip's length at 24 fps), handed `pyav_load`."""
    from diffsynth.core import UnifiedDataset
    from diffsynth.core.data.operators import LoadAudioWithTorchaudio, ToAbsolutePath

    sound = LoadAudioWithTorchaudio(num_frames=5, time_division_factor=4, time_division_remainder=1, frame_rate=24)
    sound.audio_loader = pyav_load
    return UnifiedDataset(base_path=base, metadata_path=metadata, repeat=1, data_file_keys=["video", "input_audio"],
                          main_data_operator=UnifiedDataset.default_video_operator(
                              base_path=base, height=32, width=32, height_division_factor=16,
                              width_division_factor=16, num_frames=5, time_division_factor=4,
                              time_division_remainder=1, frame_rate=24, fix_frame_rate=True),
                          special_operator_map={"input_audio": ToAbsolutePath(base) >> sound})[index]


def pyav_read_audio(path: str, resample: bool = False, resample_rate: int = 48000) -> tuple:
    """DiffSynth's read_audio (what its LoadPureAudioWithTorchaudio calls) with PyAV's decoder for torchcodec's: the
    whole track, resampled by DiffSynth's own resample_waveform."""
    from diffsynth.utils.data.audio import resample_waveform

    waveform, rate = pyav_load(path)
    return (resample_waveform(waveform, rate, resample_rate), resample_rate) if resample else (waveform, rate)


def ace_step_inputs(base: str, metadata: str, device, index: int, max_audio_duration=None) -> tuple:
    """Row `index` as ACE-Step's example reads it and its get_pipeline_inputs makes the pipeline's inputs of it
    (examples/ace_step/model_training/train.py, written out: the song at 48 kHz by LoadPureAudioWithTorchaudio, cut to
    its --max_audio_duration, its length in whole seconds, the lyrics and the metadata with its defaults, the sides
    marked)."""
    import math

    from diffsynth.core import UnifiedDataset
    from diffsynth.core.data.operators import LoadPureAudioWithTorchaudio, ToAbsolutePath

    reader = LoadPureAudioWithTorchaudio(target_sample_rate=48000, max_audio_duration=max_audio_duration)
    reader.audio_loader = pyav_read_audio
    data = UnifiedDataset(base_path=base, metadata_path=metadata, repeat=1, data_file_keys=["audio"],
                          main_data_operator=ToAbsolutePath(base) >> reader)[index]
    duration = math.floor(data["audio"][0].shape[1] / data["audio"][1])
    shared = {"input_audio": data["audio"], "lyrics": data["lyrics"], "task_type": "text2music", "duration": duration,
              "bpm": data.get("bpm", 100), "keyscale": data.get("keyscale", "C major"),
              "timesignature": data.get("timesignature", "4"), "vocal_language": data.get("vocal_language", "unknown"),
              "cfg_scale": 1, "rand_device": device, "use_gradient_checkpointing": False,
              "use_gradient_checkpointing_offload": False}
    return shared, {"prompt": data["prompt"], "positive": True}, {"positive": False}


def _example_inputs(base: str, metadata: str, flags: dict, args, glue, device, index: int = 1) -> tuple:
    from diffsynth.core import UnifiedDataset

    if _song(flags["module"]):
        return ace_step_inputs(base, metadata, device, index)

    if _video(flags["module"]):  # its video operator as the example's train.py builds it
        data = _sound_data(base, metadata, index) if _sound(flags["module"]) else UnifiedDataset(
            base_path=base, metadata_path=metadata, repeat=1, data_file_keys=["video"],
            main_data_operator=UnifiedDataset.default_video_operator(
                base_path=base, max_pixels=args.max_pixels, height=32, width=32, height_division_factor=16,
                width_division_factor=16, num_frames=5, time_division_factor=4, time_division_remainder=1))[index]
        video = data["video"]
        assert len(video) == 5
        return ({"input_video": video, "height": video[0].size[1], "width": video[0].size[0],
                 "num_frames": len(video), "cfg_scale": 1, "rand_device": device, "use_gradient_checkpointing": False,
                 "use_gradient_checkpointing_offload": False, "max_timestep_boundary": 1.0,
                 "min_timestep_boundary": 0.0, **EXAMPLE_VIDEO_INPUTS[flags["module"]]}, {"prompt": data["prompt"]}, {})
    data = UnifiedDataset(base_path=base, metadata_path=metadata,
                          repeat=1, data_file_keys=["image"],
                          main_data_operator=UnifiedDataset.default_image_operator(
                              base_path=base, max_pixels=args.max_pixels, height=args.height, width=args.width,
                              height_division_factor=glue.division, width_division_factor=glue.division))[index]
    return ({"input_image": data["image"], "height": data["image"].size[1], "width": data["image"].size[0],
             "cfg_scale": 1, "rand_device": device, "use_gradient_checkpointing": False,
             "use_gradient_checkpointing_offload": False, **EXAMPLE_INPUTS.get(flags["module"], {})},
            {"prompt": data["prompt"]}, {"negative_prompt": EXAMPLE_NEGATIVE.get(flags["module"], "")})


def diffsynths_own(root: Path, flags: dict, index: int = 1) -> tuple:
    """DiffSynth's training module on the world's files as its example builds it, and row `index`'s inputs as its
    dataset makes them: (the command's args, unitgraph's set-up, the module, the inputs)."""
    from diffsynth.core import ModelConfig

    args = _args(root, flags)
    base_model, targets, _prefix = PIPELINES[flags["module"]]
    setup = ds_run.setup(args)
    module = diffsynths_module(setup, [ModelConfig(path=m.path) for m in setup.models], base_model, targets, args.seed)
    return args, setup, module, example_inputs(root, flags, args, setup.glue, module.pipe.device, module, index=index)


def released_file(path):
    """The file DiffSynth reads where unitgraph reads `path`: the release's pickle beside a safetensors twin (JoyAI's
    `transformer.pth`, which DiffSynth's loader reads with torch.load), else `path` itself."""
    if isinstance(path, str) and path.endswith(".safetensors") and Path(path).with_suffix(".pth").is_file():
        return str(Path(path).with_suffix(".pth"))
    return path


def same_file_tensors(a: Path, b: Path) -> bool:
    """Both safetensors files hold the same tensors, bit for bit (and some)."""
    x, y = load_file(str(a)), load_file(str(b))
    return set(x) == set(y) and len(x) > 0 and all(torch.equal(x[k], y[k]) for k in x)


def assert_same_step(ours, ours_grads, theirs, theirs_grads):
    """The same loss and the same gradients, bit for bit; a parameter the step leaves without one on one side
    (Qwen-Image's last block computes a text stream nothing reads: the LoRA of its text MLP gets no gradient, which
    its example's --find_unused_parameters is for) is left so on the other too."""
    assert ours.item() == theirs.item()
    assert set(ours_grads) == set(theirs_grads) and len(ours_grads) > 0
    for name, grad in ours_grads.items():
        other = theirs_grads[name]
        assert (grad is None) == (other is None) and (grad is None or torch.equal(grad, other)), name
    assert any(g is not None and g.abs().sum() > 0 for g in ours_grads.values())


@pytest.mark.parametrize("world", sorted(PIPELINES), indirect=True)
def test_the_unsplit_step_is_diffsynths_own_training_step(world):
    """One step of `unitgraph train --pipeline diffsynth:MODULE` against DiffSynth's: the example's train.py glue
    written out here with DiffSynth's classes (from_pretrained, split_pipeline_units, switch_pipe_to_training_mode,
    UnifiedDataset with its image operator, unit_runner, FlowMatchSFTLoss), in the dtype the example trains in
    (fp32 for SD 1.5, bf16 for Ideogram 4)."""
    from diffsynth.core import ModelConfig

    root, flags = world
    args = _args(root, flags)
    base_model, targets, _prefix = PIPELINES[flags["module"]]
    setup = ds_run.setup(args)  # recognises the tiny files (registers them in DiffSynth's table for this process)
    ours, ours_grads, seed = our_unsplit_step(setup, args, base_model)
    gc.collect()  # unitgraph's pipeline gone before DiffSynth's loads (HiDream-O1's trained DiT alone is 17.6 GB)

    # DiffSynth's own: its loader on the same files, its training module, its dataset, its loss
    configs = [ModelConfig(path=released_file(m.path)) for m in setup.models]  # the files the model ids name
    module = diffsynths_module(setup, configs, base_model, targets, args.seed)
    inputs = example_inputs(root, flags, args, setup.glue, module.pipe.device, module)
    theirs, theirs_grads = diffsynths_step(module, inputs, seed, base_model,
                                           sft=EXAMPLE_SFT_LOSS.get(flags["module"], "FlowMatchSFTLoss"))
    assert_same_step(ours, ours_grads, theirs, theirs_grads)


@pytest.mark.parametrize("world", ["stable_diffusion"], indirect=True)
def test_the_training_recipe_trains_split_as_unsplit_and_resumes_exactly(world, tmp_path):
    """unitgraph's recipe on a DiffSynth pipeline: --optimizer adafactor (transformers'), --lr_scheduler cosine with
    --lr_warmup_steps 2, --ema_decay 0.9 and --max_grad_norm. Split == unsplit (losses, LoRA and its average bit for
    bit); a run resumed from the state after epoch 0 ends on the same LoRA and average (Adafactor's per-parameter
    step counts come back as the numbers they were); the average is diffusers' EMAModel over the LoRA after each
    step; the schedule warms up over 2 steps; clipping changes what is trained; an optimizer other than AdamW under
    an engine is refused in one line."""
    import json

    from diffusers.training_utils import EMAModel

    root, flags = world
    recipe = dict(optimizer="adafactor", lr_scheduler="cosine", lr_warmup_steps=2, ema_decay=0.9, max_grad_norm=0.05,
                  learning_rate=1e-2, save_steps=1, save_total_limit=0)
    whole = run(_args(root, flags, output_path=str(tmp_path / "whole"), **recipe))
    run(_args(root, flags, task="sft:data_process", output_path=str(tmp_path / "cache"), **recipe))
    split = run(_args(root, flags, task="sft:train", dataset_base_path=str(tmp_path / "cache"),
                      dataset_metadata_path=None, output_path=str(tmp_path / "split"), **recipe))
    assert whole.losses == split.losses and len(whole.losses) == 6
    out = tmp_path / "whole"
    for name in ("epoch-1.safetensors", "epoch-1-ema.safetensors"):
        a, b = load_file(str(out / name)), load_file(str(tmp_path / "split" / name))
        assert set(a) == set(b) and a and all(torch.equal(a[k], b[k]) for k in a), name

    # the average: diffusers' EMAModel stepped on the LoRA after each of the 6 steps
    after = ["step-1", "step-2", "epoch-0", "step-4", "step-5", "epoch-1"]
    loras = [load_file(str(out / f"{name}.safetensors")) for name in after]
    keys = sorted(loras[0])
    params = [torch.nn.Parameter(loras[0][k].clone()) for k in keys]
    reference = EMAModel(params, decay=0.9)
    for lora in loras:
        with torch.no_grad():
            for p, k in zip(params, keys):
                p.copy_(lora[k])
        reference.step(params)
    average = load_file(str(out / "epoch-1-ema.safetensors"))
    assert all(torch.equal(average[k], s) for k, s in zip(keys, reference.shadow_params))
    assert not all(torch.equal(average[k], loras[-1][k]) for k in keys)
    state = json.loads((out / "state" / "step-1" / "state.json").read_text())
    assert state["param_groups"][0]["relative_step"] is False  # Adafactor's, as unitgraph builds it
    assert state["param_groups"][0]["lr"] == pytest.approx(5e-3)  # half way through the warm-up
    assert json.loads((out / "state" / "step-2" / "state.json").read_text())["param_groups"][0]["lr"] == \
        pytest.approx(1e-2)
    assert any(k.endswith("#int") for k in load_file(str(out / "state" / "step-1" / "optimizer.safetensors")))

    cut = tmp_path / "cut"
    shutil.copytree(out, cut, ignore=shutil.ignore_patterns("step-4*", "step-5*", "step-6", "epoch-1*"))
    resumed = run(_args(root, flags, output_path=str(cut), resume="latest", **recipe))
    assert resumed.losses == whole.losses[3:]
    for name in ("epoch-1.safetensors", "epoch-1-ema.safetensors"):
        a, b = load_file(str(out / name)), load_file(str(cut / name))
        assert all(torch.equal(a[k], b[k]) for k in a), name

    unclipped = run(_args(root, flags, output_path=str(tmp_path / "unclipped"), **{**recipe, "max_grad_norm": None}))
    assert unclipped.losses[0] == whole.losses[0] and unclipped.losses != whole.losses

    config = tmp_path / "fsdp2.yaml"
    config.write_text("distributed_type: FSDP\nnum_processes: 2\nfsdp_config:\n  fsdp_version: 2\n")
    with pytest.raises(BackendError, match="--optimizer adafactor with FSDP2: the engine's training states keep "
                                           "AdamW's moments per shard"):
        run(_args(root, flags, dry_run=True, config_file=str(config), **recipe))


@pytest.mark.parametrize("world", ["stable_diffusion", "z_image"], indirect=True)
def test_caption_dropout_trains_split_as_unsplit_on_the_empty_caption(world, tmp_path):
    """--caption_dropout on a DiffSynth pipeline (captions.py): at 1.0 the first step is DiffSynth's own training step
    on its sample with the caption "" (the dataset refuses an empty caption, so DiffSynth's inputs are edited); at
    0.5 split == unsplit bit for bit, stage 1 storing per entry only what the empty caption changes (the prompt
    embedder's outputs, so stage 2 needs no text encoder), some steps dropped and some not, and the run trains
    otherwise than without dropout; stage 2 from a cache made without it, and a resumed run with another
    probability, are refused in one line."""
    from unitgraph.backends.diffusion.cache.entries import read_entry
    from unitgraph.backends.diffusion.diffsynth_source.captions import EMPTY_CAPTION, dropped

    root, flags = world
    common = dict(num_epochs=2)
    always = run(_args(root, flags, caption_dropout=1.0, output_path=str(tmp_path / "always"), **common))
    first = int((tmp_path / "always" / "loss.csv").read_text().splitlines()[1].split(",")[2])  # step 1's row
    args, setup, module, (shared, posi, nega) = diffsynths_own(root, flags, index=first)
    base_model = PIPELINES[flags["module"]][0]
    assert posi["prompt"]  # the row's own caption, which the step replaces by ""
    seed = ds_run.step_seed(args.seed, 0, ds_run.dataset_of(setup).sample_id(first))
    theirs, _grads = diffsynths_step(module, (shared, {**posi, "prompt": ""}, nega), seed, base_model)
    assert always.losses[0] == theirs.item()

    half = dict(common, caption_dropout=0.5)
    whole = run(_args(root, flags, output_path=str(tmp_path / "whole"), **half))
    plain = run(_args(root, flags, output_path=str(tmp_path / "plain"), **common))
    assert whole.losses != plain.losses
    cache = tmp_path / "cache"
    run(_args(root, flags, task="sft:data_process", output_path=str(cache), **half))
    entry, _meta = read_entry(next((cache / "entries").iterdir()))
    changed = {part: sorted(values) for part, values in entry[EMPTY_CAPTION].items() if values}
    assert changed and "inputs_posi" in changed and not changed.get("inputs_shared"), changed  # the prompt's outputs
    split = run(_args(root, flags, task="sft:train", dataset_base_path=str(cache), dataset_metadata_path=None,
                      output_path=str(tmp_path / "split"), **half))
    assert split.losses == whole.losses
    assert same_file_tensors(split.last_checkpoint, whole.last_checkpoint)
    dataset = ds_run.dataset_of(ds_run.setup(_args(root, flags)))
    draws = [dropped(3, epoch, dataset.sample_id(i), 0.5) for epoch in range(2) for i in range(len(dataset))]
    assert any(draws) and not all(draws)  # both kinds of step were trained

    plain_cache = tmp_path / "plain-cache"
    run(_args(root, flags, task="sft:data_process", output_path=str(plain_cache), **common))
    with pytest.raises(BackendError, match="--caption_dropout: this cache holds no empty-caption states"):
        run(_args(root, flags, task="sft:train", dataset_base_path=str(plain_cache), dataset_metadata_path=None,
                  output_path=str(tmp_path / "x"), **half))
    with pytest.raises(BackendError, match="caption_dropout"):
        run(_args(root, flags, output_path=str(tmp_path / "whole"), resume="latest", **dict(half, caption_dropout=0.2)))


@pytest.mark.parametrize("world", ["stable_diffusion", "z_image"], indirect=True)
def test_timestep_samplings_and_weightings_train_split_as_unsplit(world, tmp_path):
    """--timestep_sampling and --weighting_scheme on a DiffSynth pipeline (objective.py): at the defaults unitgraph's
    loss is DiffSynth's FlowMatchSFTLoss bit for bit, and overwrites the same params (the plan is the same); at the
    same drawn timestep a weighting is the unweighted loss times its weight (DiffSynth's training weight; diffusers'
    SD3 weight at the scheduler's sigma), bit for bit; logit_normal (with cosmap on Z-Image's flow-matching
    schedule, none on SD 1.5's DDIM) trains split == unsplit bit for bit, and otherwise than the defaults; an SD3
    weighting on a DDIM pipeline, a sampling with direct_distill and a resumed run with another sampling are refused
    in one line."""
    from diffsynth.diffusion.loss import FlowMatchSFTLoss
    from diffusers.training_utils import compute_loss_weighting_for_sd3

    from unitgraph.backends.diffusion.diffsynth_source.objective import flow_match_sft
    from unitgraph.backends.diffusion.diffsynth_source.planning import loss_overwrites
    from unitgraph.backends.diffusion.flowmatch import TimestepSampling

    root, flags = world
    flow = flags["module"] == "z_image"
    _given, _setup, module, inputs = diffsynths_own(root, flags)
    pipe = module.pipe
    drawn = []
    model_fn = pipe.model_fn

    def recording(*a, **kw):
        drawn.append(kw["timestep"])
        return model_fn(*a, **kw)

    pipe.model_fn = recording

    def loss_with(loss) -> torch.Tensor:
        state = module.transfer_data_to_device(inputs, pipe.device, pipe.torch_dtype)
        torch.manual_seed(11)
        for unit in pipe.units:
            state = pipe.unit_runner(unit, pipe, *state)
        with torch.no_grad():
            return loss(pipe, **state[0], **state[1])

    def ours(scheme: str = "diffsynth", weighting: str = "diffsynth"):
        return lambda p, **i: flow_match_sft(p, TimestepSampling(scheme), weighting, **i)

    assert loss_overwrites(flow_match_sft) == loss_overwrites(FlowMatchSFTLoss) == {"latents"}
    theirs = loss_with(FlowMatchSFTLoss)
    assert torch.equal(loss_with(ours()), theirs)
    plain = loss_with(ours(weighting="none"))
    timestep = drawn[-1]
    assert torch.equal(drawn[0], timestep)  # the same position each time: the same stream
    assert torch.equal(theirs, plain * pipe.scheduler.training_weight(timestep))
    if flow:
        sigma = pipe.scheduler.sigmas[torch.argmin((pipe.scheduler.timesteps - timestep.cpu()).abs())]
        weight = compute_loss_weighting_for_sd3("sigma_sqrt", sigma.reshape(1)).float()[0]
        assert torch.equal(loss_with(ours(weighting="sigma_sqrt")), plain * weight) and weight != 1

    chosen = dict(timestep_sampling="logit_normal", weighting_scheme="cosmap" if flow else "none", num_epochs=1)
    whole = run(_args(root, flags, output_path=str(tmp_path / "whole"), **chosen))
    default = run(_args(root, flags, output_path=str(tmp_path / "default"), num_epochs=1))
    assert whole.losses != default.losses and whole.losses[0] != default.losses[0]
    run(_args(root, flags, task="sft:data_process", output_path=str(tmp_path / "cache"), num_epochs=1))
    split = run(_args(root, flags, task="sft:train", dataset_base_path=str(tmp_path / "cache"),
                      dataset_metadata_path=None, output_path=str(tmp_path / "split"), **chosen))
    assert split.losses == whole.losses
    assert same_file_tensors(split.last_checkpoint, whole.last_checkpoint)
    with pytest.raises(BackendError, match="the state was made with timestep_sampling"):
        run(_args(root, flags, output_path=str(tmp_path / "whole"), resume="latest",
                  **dict(chosen, timestep_sampling="mode")))
    with pytest.raises(BackendError, match="--timestep_sampling logit_normal: --task direct_distill trains "
                                           "DiffSynth's own direct_distill loss"):
        ds_run.check_flags(_args(root, flags, task="direct_distill", timestep_sampling="logit_normal"))
    if not flow:
        with pytest.raises(BackendError, match="--weighting_scheme sigma_sqrt: StableDiffusionPipeline trains with "
                                               "DDIMScheduler, which has no sigma"):
            run(_args(root, flags, output_path=str(tmp_path / "x"), weighting_scheme="sigma_sqrt"))


@pytest.mark.parametrize("world", ["stable_diffusion", "z_image", "flux2_image"], indirect=True)
def test_masked_loss_weighs_each_latent_cell_and_trains_split_as_unsplit(world, tmp_path):
    """--masked_loss on a DiffSynth pipeline (objective.py): at the same draws the losses of two complementary masks
    (left and right halves, W 0) add up to the unmasked mean squared error, and W 1 is that error; stage 1 caches
    each sample's mask resized as its image (the loss averages it over the latent's cells, which SD 1.5 makes in
    stage 2, and FLUX.2 [klein] lays out as tokens);
    split == unsplit bit for bit, and otherwise than unmasked; a video pipeline, a cache without masks and a mask of
    another size than its image are refused in one line."""
    import json
    from dataclasses import replace

    from PIL import Image

    from unitgraph.backends.diffusion.cache.entries import read_entry
    from unitgraph.backends.diffusion.data.dataset import add_synthetic_masks
    from unitgraph.backends.diffusion.diffsynth_source.objective import LOSS_MASK, flow_match_sft, mask_pixels
    from unitgraph.backends.diffusion.flowmatch import TimestepSampling

    root, flags = world
    args, _setup, module, inputs = diffsynths_own(root, flags)
    pipe = module.pipe
    left = Image.new("L", (32, 32), 0)
    left.paste(255, (0, 0, 16, 32))
    right = Image.eval(left, lambda v: 255 - v)

    def loss_with(mask=None, unmasked=None) -> torch.Tensor:
        state = module.transfer_data_to_device(inputs, pipe.device, pipe.torch_dtype)
        torch.manual_seed(11)
        for unit in pipe.units:
            state = pipe.unit_runner(unit, pipe, *state)
        shared = dict(state[0])
        if mask is not None:
            shared[LOSS_MASK] = mask_pixels(mask)
        with torch.no_grad():
            return flow_match_sft(pipe, TimestepSampling(), "none", unmasked, **shared, **state[1])

    plain = loss_with()
    halves = loss_with(left, 0.0) + loss_with(right, 0.0)
    assert torch.allclose(halves, plain, rtol=1e-5, atol=0) and 0 < loss_with(left, 0.0) < plain
    assert torch.allclose(loss_with(left, 1.0), plain, rtol=1e-6, atol=0)

    data = tmp_path / "masked"
    shutil.copytree(root / "data", data)
    add_synthetic_masks(data)  # row 0: the left half white, row 1: a ramp, row 2: all white
    masked = dict(dataset_base_path=str(data), dataset_metadata_path=str(data / "metadata.csv"), num_epochs=1,
                  masked_loss=True)
    whole = run(_args(root, flags, output_path=str(tmp_path / "whole"), **masked))
    plain_run = run(_args(root, flags, output_path=str(tmp_path / "plain"),
                          **{k: v for k, v in masked.items() if k != "masked_loss"}))
    assert whole.losses != plain_run.losses
    cache = tmp_path / "cache"
    run(_args(root, flags, task="sft:data_process", output_path=str(cache), **masked))
    manifest = json.loads((cache / ds_run.MANIFEST).read_text())
    first = next(e for e in manifest["entries"] if e["row"] == 0)
    pixels = read_entry(cache / first["file"])[0]["inputs_shared"][LOSS_MASK]  # resized as the image, 40 -> 32 px
    assert pixels.shape == (32, 32, 3) and pixels.dtype == torch.uint8
    assert pixels[:, :15].min() == 255 and pixels[:, 17:].max() == 0
    split = run(_args(root, flags, task="sft:train", dataset_base_path=str(cache), dataset_metadata_path=None,
                      output_path=str(tmp_path / "split"), masked_loss=True, num_epochs=1))
    assert split.losses == whole.losses
    assert same_file_tensors(split.last_checkpoint, whole.last_checkpoint)

    plain_cache = tmp_path / "plain-cache"
    run(_args(root, flags, task="sft:data_process", output_path=str(plain_cache), num_epochs=1))
    with pytest.raises(BackendError, match="--masked_loss: this cache holds no loss masks"):
        run(_args(root, flags, task="sft:train", dataset_base_path=str(plain_cache), dataset_metadata_path=None,
                  output_path=str(tmp_path / "x"), masked_loss=True))
    with pytest.raises(BackendError, match="--masked_loss: diffsynth:wan_video trains on clips"):
        ds_run.check_flags(replace(args, pipeline="diffsynth:wan_video", masked_loss=True))
    Image.new("L", (24, 24), 255).save(data / "mask-1.png")
    with pytest.raises(BackendError, match="row 2: the mask 'mask-1.png' is 24x24 px, its image"):
        run(_args(root, flags, output_path=str(tmp_path / "y"), **masked))


@pytest.mark.parametrize("world", ["stable_diffusion"], indirect=True)
def test_schedule_free_checkpoints_its_averaged_weights_and_resumes_exactly(world, tmp_path):
    """--optimizer schedulefree on a DiffSynth pipeline (its two weight sequences): a checkpoint holds the averaged
    weights schedulefree's eval() makes (x = y + (1 - 1/beta1)(z - y) of the training weights y and z of the state
    written with it, to float rounding: the state holds y after train() switched back, which is not eval()'s exact
    inverse), and a state the training weights, which the run continues: split == unsplit and a run resumed from a
    state mid-run ends on the same checkpoint, bit for bit."""
    import json

    root, flags = world
    common = dict(optimizer="schedulefree", learning_rate=1e-2, save_steps=2, save_total_limit=0)
    whole = run(_args(root, flags, output_path=str(tmp_path / "whole"), **common))
    out = tmp_path / "whole"
    state = out / "state" / "step-4"
    names = json.loads((state / "state.json").read_text())["names"]
    y, z = load_file(str(state / "trained.safetensors")), load_file(str(state / "optimizer.safetensors"))
    checkpoint = load_file(str(out / "step-4.safetensors"))
    _base, _targets, prefix = PIPELINES[flags["module"]]
    assert len(names) == len(checkpoint) > 0
    for i, name in enumerate(names):
        averaged = y[name].lerp(z[f"{i}.z"], 1 - 1 / 0.9)
        written = checkpoint[name[len(prefix):]]
        assert torch.allclose(written, averaged, rtol=1e-5, atol=1e-9), name
        assert not torch.allclose(written, y[name], rtol=1e-3, atol=0), name

    run(_args(root, flags, task="sft:data_process", output_path=str(tmp_path / "cache")))
    split = run(_args(root, flags, task="sft:train", dataset_base_path=str(tmp_path / "cache"),
                      dataset_metadata_path=None, output_path=str(tmp_path / "split"), **common))
    assert split.losses == whole.losses
    assert same_file_tensors(tmp_path / "split" / "epoch-1.safetensors", out / "epoch-1.safetensors")
    cut = tmp_path / "cut"
    shutil.copytree(out, cut, ignore=shutil.ignore_patterns("step-4*", "step-5*", "step-6", "epoch-1*"))
    resumed = run(_args(root, flags, output_path=str(cut), resume="latest", **common))
    assert resumed.losses == whole.losses[3:]
    assert same_file_tensors(cut / "epoch-1.safetensors", out / "epoch-1.safetensors")


@pytest.mark.parametrize("world", ["stable_diffusion"], indirect=True)
def test_the_held_out_loss_comes_from_the_cache_and_changes_no_step(world, tmp_path):
    """--validation_dataset: stage 1 caches the held-out samples apart; stage 2 logs their mean loss (seeded draws,
    no gradient) every --validation_steps optimizer steps, else at each epoch's end, to validation_loss.csv, and
    trains exactly what it trains without them; a resumed run keeps the rows before its state and adds the same ones
    after it; a cache without held-out samples is refused in one line."""
    from unitgraph.backends.diffusion.train.held_out import read_held_out_csv

    root, flags = world
    held = tmp_path / "held"
    write_synthetic_dataset(held, count=2, size=40, seed=5)
    metadata = str(held / "metadata.csv")
    run(_args(root, flags, task="sft:data_process", output_path=str(tmp_path / "cache"), validation_dataset=metadata))
    run(_args(root, flags, task="sft:data_process", output_path=str(tmp_path / "plain")))
    stage_2 = dict(task="sft:train", dataset_metadata_path=None, save_steps=2, save_total_limit=0)
    out = tmp_path / "out"
    logged = run(_args(root, flags, dataset_base_path=str(tmp_path / "cache"), output_path=str(out),
                       validation_steps=2, **stage_2))
    plain = run(_args(root, flags, dataset_base_path=str(tmp_path / "plain"), output_path=str(tmp_path / "p"),
                      **stage_2))
    assert logged.losses == plain.losses
    a, b = load_file(str(logged.last_checkpoint)), load_file(str(plain.last_checkpoint))
    assert all(torch.equal(a[k], b[k]) for k in a)
    rows = read_held_out_csv(out / "validation_loss.csv")
    assert [r["step"] for r in rows] == [2, 4, 6] and {r["samples"] for r in rows} == {2}
    assert len({r["loss"] for r in rows}) == 3  # the weights changed between evaluations, the draws did not

    cut = tmp_path / "cut"
    shutil.copytree(out, cut, ignore=shutil.ignore_patterns("step-4*", "step-5*", "step-6", "epoch-1*"))
    run(_args(root, flags, dataset_base_path=str(tmp_path / "cache"), output_path=str(cut), validation_steps=2,
              resume="latest", **stage_2))
    assert read_held_out_csv(cut / "validation_loss.csv") == rows

    epochs = run(_args(root, flags, dataset_base_path=str(tmp_path / "cache"), output_path=str(tmp_path / "e"),
                       **stage_2))
    assert [r["step"] for r in read_held_out_csv(Path(epochs.output_path) / "validation_loss.csv")] == [3, 6]
    with pytest.raises(BackendError, match="--validation_dataset: this cache holds no held-out samples"):
        run(_args(root, flags, dataset_base_path=str(tmp_path / "plain"), output_path=str(tmp_path / "x"),
                  validation_dataset=metadata, **stage_2))


# the columns DiffSynth's direct-distill datasets add, as its Wan 2.1 1.3B direct_distill example passes them
DISTILL_COLUMNS = "seed,rand_device,num_inference_steps,cfg_scale"


def distill_data(root: Path, folder: Path) -> Path:
    """The world's samples copied to `folder`, with the columns of DiffSynth's direct-distill datasets (seeds 40+)."""
    shutil.copytree(root / "data", folder)
    add_distill_columns(folder)
    return folder


@pytest.mark.parametrize("world", ["wan_video", "z_image"], indirect=True)
def test_direct_distill_is_diffsynths_own_step_and_split_equals_unsplit(world, tmp_path):
    """--task direct_distill: the example's DirectDistillLoss (the sample's seeded noise denoised in its
    num_inference_steps by the trained DiT, the result against the target's latents), the columns read as DiffSynth
    reads them (numbers, not the csv's text). The unsplit step equals DiffSynth's own bit for bit; the noise is
    made in stage 1 from the row's seed; split (direct_distill:data_process, then :train) == unsplit, losses and
    LoRA; a pipeline whose example offers no direct_distill (Ideogram 4) is refused in one line."""
    from diffsynth.core import ModelConfig

    root, flags = world
    base_model, targets, _prefix = PIPELINES[flags["module"]]
    data = distill_data(root, tmp_path / "data")
    common = dict(dataset_base_path=str(data), dataset_metadata_path=str(data / "metadata.csv"),
                  extra_inputs=DISTILL_COLUMNS, num_epochs=1)
    args = _args(root, flags, task="direct_distill", **common)
    setup = ds_run.setup(args)
    assert any("noise" in u.lower() for u in setup.plan.data_process_units), setup.plan.data_process_units
    assert set(setup.plan.train_models) & setup.given == {base_model}  # the VAE encodes the target and passes the noise on in stage 1
    ours, ours_grads, seed = our_unsplit_step(setup, args, base_model)
    module = diffsynths_module(setup, [ModelConfig(path=m.path) for m in setup.models], base_model, targets,
                               args.seed)
    inputs = example_inputs(root, flags, args, setup.glue, module.pipe.device, module)
    assert inputs[0]["num_inference_steps"] == 2 and inputs[0]["seed"] == 41
    theirs, theirs_grads = diffsynths_step(module, inputs, seed, base_model, "direct_distill")
    assert_same_step(ours, ours_grads, theirs, theirs_grads)

    whole = run(_args(root, flags, task="direct_distill", output_path=str(tmp_path / "whole"), **common))
    run(_args(root, flags, task="direct_distill:data_process", output_path=str(tmp_path / "cache"), **common))
    split = run(_args(root, flags, task="direct_distill:train", output_path=str(tmp_path / "split"),
                      **{**common, "dataset_base_path": str(tmp_path / "cache"), "dataset_metadata_path": None}))
    assert whole.losses == split.losses and len(split.losses) == 3
    assert same_file_tensors(whole.last_checkpoint, split.last_checkpoint)
    rows = (data / "metadata.csv").read_text(encoding="utf-8").splitlines()
    (data / "metadata.csv").write_text("\n".join([rows[0], rows[1], rows[2].replace(",41,", ",,"), *rows[3:]]) + "\n",
                                       encoding="utf-8")
    with pytest.raises(BackendError, match="row 2: the seed column is empty, and .*Noise.* the sample's noise"):
        run(_args(root, flags, task="direct_distill:data_process", output_path=str(tmp_path / "cache2"), **common))
    with pytest.raises(BackendError, match="diffsynth:ideogram4's example trains no direct_distill task"):
        ds_run.check_flags(_args(root, flags, task="direct_distill", pipeline="diffsynth:ideogram4"))


@pytest.mark.parametrize("world", ["z_image"], indirect=True)
def test_fp8_models_train_as_diffsynths_fp8_step_and_split_equals_unsplit(world, tmp_path):
    """--fp8_models as DiffSynth's train.py takes it: its model id of the DiT (the LoRA base) and, in unitgraph's
    form, the text encoder's attribute. The unsplit step equals DiffSynth's own step on the models its
    parse_model_configs(fp8_models=...) loads (every weight in float8_e4m3fn) bit for bit; it is not the bf16 step;
    split == unsplit with the fp8 text encoder in stage 1 and the fp8 DiT in stage 2; the dry run counts the fp8
    models at a byte a weight."""
    from diffsynth.diffusion.training_module import DiffusionTrainingModule

    root, flags = world
    base_model, targets, _prefix = PIPELINES[flags["module"]]
    plain = ds_run.setup(_args(root, flags))
    dit_id = next(m.given for m in plain.models if base_model in m.attributes)
    args = _args(root, flags, fp8_models=f"{dit_id},text_encoder")
    setup = ds_run.setup(args)
    assert sorted(a for m in setup.models if m.fp8 for a in m.attributes) == [base_model, "text_encoder"]
    ours, ours_grads, seed = our_unsplit_step(setup, args, base_model)
    bf16, _grads, _seed = our_unsplit_step(plain, args, base_model)
    assert ours.item() != bf16.item()

    their_ids = ",".join(m.given for m in setup.models if m.fp8)  # DiffSynth's --fp8_models names ids only
    configs = DiffusionTrainingModule().parse_model_configs(None, args.model_id_with_origin_paths,
                                                            fp8_models=their_ids, device="cpu")
    module = diffsynths_module(setup, configs, base_model, targets, args.seed)
    assert {p.dtype for p in module.pipe.text_encoder.parameters()} == {torch.float8_e4m3fn}
    inputs = example_inputs(root, flags, args, setup.glue, module.pipe.device, module)
    theirs, theirs_grads = diffsynths_step(module, inputs, seed, base_model)
    assert_same_step(ours, ours_grads, theirs, theirs_grads)

    common = dict(fp8_models=args.fp8_models, num_epochs=1)
    whole = run(_args(root, flags, output_path=str(tmp_path / "whole"), **common))
    run(_args(root, flags, task="sft:data_process", output_path=str(tmp_path / "cache"), **common))
    split = run(_args(root, flags, task="sft:train", dataset_base_path=str(tmp_path / "cache"),
                      dataset_metadata_path=None, output_path=str(tmp_path / "split"), **common))
    assert whole.losses == split.losses and len(split.losses) == 3
    assert same_file_tensors(whole.last_checkpoint, split.last_checkpoint)

    fp8_plan = run(_args(root, flags, dry_run=True, fp8_models=args.fp8_models)).memory_plan["models"]
    bf16_plan = run(_args(root, flags, dry_run=True)).memory_plan["models"]
    for name in (base_model, "text_encoder"):
        assert fp8_plan[name]["fp8"] and fp8_plan[name]["bytes"] * 2 == bf16_plan[name]["bytes"]
    others = set(fp8_plan) - {base_model, "text_encoder"}
    assert others and all(not fp8_plan[n]["fp8"] and fp8_plan[n]["bytes"] == bf16_plan[n]["bytes"] for n in others)

    # refused in one line: a name of no model, a model whose weights train, the DiT's fp8 under an engine
    with pytest.raises(BackendError, match="--fp8_models 'transformer' names no model of the command"):
        ds_run.setup(_args(root, flags, fp8_models="transformer"))
    with pytest.raises(BackendError, match="--fp8_models: dit is in --trainable_models; a model whose weights train cannot"):
        ds_run.setup(_args(root, flags, fp8_models=dit_id, lora_base_model=None, trainable_models="dit"))
    # --offload_models, as DiffSynth's split commands name the models a stage does not compute with: nothing to say
    # where the stage does not load them; a line where it computes with one
    te_id = next(m.given for m in setup.models if "text_encoder" in m.attributes)
    assert ds_run.offload_notes(ds_run.setup(_args(root, flags, task="sft:train", offload_models=te_id))) == []
    notes = ds_run.offload_notes(ds_run.setup(_args(root, flags, offload_models=te_id)))
    assert len(notes) == 1 and notes[0].startswith("--offload_models: text_encoder computes in this stage"), notes
    with pytest.raises(BackendError, match="--offload_models 'nope' names no model of the command"):
        ds_run.offload_notes(ds_run.setup(_args(root, flags, offload_models="nope")))
    config = tmp_path / "fsdp2.yaml"
    config.write_text("distributed_type: FSDP\nnum_processes: 2\nfsdp_config:\n  fsdp_version: 2\n")
    with pytest.raises(BackendError, match="--fp8_models with FSDP2: dit trains under the engine, which shards"):
        run(_args(root, flags, dry_run=True, fp8_models="dit", config_file=str(config)))


def _edit_dataset(folder: Path) -> Path:
    """3 rows in DiffSynth's JSON metadata: a 40 px target image, a prompt and two 40 px reference images (the
    edit example of examples/flux2/model_training/full/FLUX.2-klein-4B.sh: --data_file_keys "image,edit_image"
    --extra_inputs "edit_image")."""
    import csv
    import json

    write_synthetic_dataset(folder, count=3, size=40)
    with (folder / "metadata.csv").open(encoding="utf-8") as handle:
        rows = list(csv.DictReader(handle))
    meta = [{"image": r["image"], "prompt": r["prompt"],
             "edit_image": [rows[(i + 1) % 3]["image"], rows[(i + 2) % 3]["image"]]} for i, r in enumerate(rows)]
    (folder / "metadata.json").write_text(json.dumps(meta, indent=1), encoding="utf-8")
    return folder / "metadata.json"


@pytest.mark.parametrize("world", ["flux2_image"], indirect=True)
def test_an_edit_step_is_diffsynths_own_with_its_references_resized(world, tmp_path):
    """FLUX.2 [klein] trained on edits: the references (a list of two 40 px images a row) go through DiffSynth's image
    operator as the target does (to 32 px); unitgraph's unsplit step equals DiffSynth's own, loss and LoRA gradients
    bit for bit. Before, only the target image was resized."""
    from diffsynth.core import ModelConfig, UnifiedDataset
    from diffsynth.diffusion.training_module import DiffusionTrainingModule

    root, flags = world
    metadata = _edit_dataset(tmp_path / "edit")
    args = _args(root, flags, dataset_base_path=str(tmp_path / "edit"), dataset_metadata_path=str(metadata),
                 data_file_keys="image,edit_image", extra_inputs="edit_image")
    base_model, targets, _prefix = PIPELINES[flags["module"]]
    setup = ds_run.setup(args)
    assert "EditImageEmbedder" in setup.plan.data_process_units
    pipe = setup.load(sorted(set(setup.plan.data_process_models) | set(setup.plan.train_models)), "the run")
    ds_run._lora(setup, pipe)
    dataset = ds_run.dataset_of(setup)
    state = ds_run.sample_state(setup, dataset, 1, pipe.device)
    assert [im.size for im in state[0]["edit_image"]] == [(32, 32), (32, 32)]
    state = ds_run.run_units(pipe, setup.stage_units("data_process"), ds_run._transfer(state, pipe))
    seed = ds_run.step_seed(args.seed, 0, dataset.sample_id(1))
    ours = ds_run.train_step(pipe, setup.stage_units("train"), state, seed)
    ours.backward()
    ours_grads = {n: p.grad.clone() for n, p in getattr(pipe, base_model).named_parameters() if p.requires_grad}

    module = DiffusionTrainingModule()
    tokenizers = {k: ModelConfig(path=v) for k, v in
                  setup.tokenizers_for([t.encoder for t in setup.glue.tokenizers]).items()}
    module.pipe = setup.pipe_class.from_pretrained(torch_dtype=torch.bfloat16, device="cpu",
                                                   model_configs=[ModelConfig(path=m.path) for m in setup.models],
                                                   **tokenizers)
    module.pipe = module.split_pipeline_units("sft", module.pipe, None, base_model)
    with seeded_global_stream(args.seed, "diffsynth-lora-init"):
        module.switch_pipe_to_training_mode(module.pipe, None, base_model, targets, 4, None, None, None, task="sft")
    pipe2 = module.pipe
    data = UnifiedDataset(base_path=str(tmp_path / "edit"), metadata_path=str(metadata), repeat=1,
                          data_file_keys=["image", "edit_image"],
                          main_data_operator=UnifiedDataset.default_image_operator(
                              base_path=str(tmp_path / "edit"), max_pixels=args.max_pixels, height=32, width=32,
                              height_division_factor=16, width_division_factor=16))[1]
    shared = {"input_image": data["image"], "height": data["image"].size[1], "width": data["image"].size[0],
              "cfg_scale": 1, "rand_device": pipe2.device, "use_gradient_checkpointing": False,
              "use_gradient_checkpointing_offload": False, **EXAMPLE_INPUTS["flux2_image"]}
    shared = module.parse_extra_inputs(data, ["edit_image"], shared)
    theirs, theirs_grads = diffsynths_step(module, (shared, {"prompt": data["prompt"]}, {"negative_prompt": ""}),
                                           seed, base_model)
    assert ours.item() == theirs.item()
    assert set(ours_grads) == set(theirs_grads) and all(torch.equal(g, theirs_grads[n]) for n, g in ours_grads.items())


@pytest.mark.parametrize("world", sorted(PIPELINES), indirect=True)
def test_split_equals_unsplit_and_stage_2_needs_no_text_encoder(world, tmp_path):
    root, flags = world
    unsplit = run(_args(root, flags, output_path=str(tmp_path / "sft")))
    cache = tmp_path / "cache"
    s1 = run(_args(root, flags, task="sft:data_process", output_path=str(cache)))
    assert s1.entries_computed == 3 and (cache / ds_run.MANIFEST).is_file()
    # stage 2 without the text encoder's file on disk (nor any other file of stage 1's models alone), unnamed
    setup = ds_run.setup(_args(root, flags))
    given = flags["model_id_with_origin_paths"].split(",")
    kept = [i for i, m in zip(given, setup.models) if set(m.attributes) & set(setup.plan.train_models)]

    def folder(m) -> Path:  # (a model in shards: their folder)
        return Path(m.path if isinstance(m.path, str) else m.path[0]).parent

    folders = {folder(m) for i, m in zip(given, setup.models) if i not in kept}
    folders -= {folder(m) for i, m in zip(given, setup.models) if i in kept}
    if setup.plan.data_process_models:
        assert any(a.startswith("text_encoder") for i, m in zip(given, setup.models) if folder(m) in folders
                   for a in m.attributes)  # FLUX.2 [klein]'s is text_encoder_qwen3
    else:  # HiDream-O1: stage 1 only tokenizes (its processor beside the DiT's shards), stage 2 trains the one model
        assert flags["module"] == "hidream_o1_image" and not folders and len(kept) == len(given)
    hidden = {folder: tmp_path / f"hidden{n}" for n, folder in enumerate(sorted(folders))}
    for folder, where in hidden.items():
        shutil.move(str(folder), str(where))
    try:
        split = run(_args(root, flags, task="sft:train", dataset_base_path=str(cache), dataset_metadata_path=None,
                          model_id_with_origin_paths=",".join(kept), output_path=str(tmp_path / "split")))
    finally:
        for folder, where in hidden.items():
            shutil.move(str(where), str(folder))
    assert unsplit.losses == split.losses and len(split.losses) == 6
    assert same_file_tensors(unsplit.last_checkpoint, split.last_checkpoint)
    assert unsplit.last_checkpoint.name == "epoch-1.safetensors"
    # a second stage 1 reuses every entry
    again = run(_args(root, flags, task="sft:data_process", output_path=str(cache)))
    assert again.entries_computed == 0 and again.entries_reused == 3


@pytest.mark.parametrize("world", sorted(PIPELINES), indirect=True)
def test_the_checkpoint_loads_with_diffsynths_load_lora(world, tmp_path):
    root, flags = world
    result = run(_args(root, flags, output_path=str(tmp_path / "out"), num_epochs=1, learning_rate=1e-2))
    lora = load_file(str(result.last_checkpoint))
    assert lora and all(k.endswith(("lora_A.default.weight", "lora_B.default.weight")) for k in lora)
    assert not any(k.startswith("pipe.") for k in lora)
    base_model = PIPELINES[flags["module"]][0]
    setup = ds_run.setup(_args(root, flags))
    pipe = setup.load([base_model], "the check")
    model = getattr(pipe, base_model)
    # a copy of four weights the file's LoRA moved (its B trained away from zero), not of every weight it targets:
    # HiDream-O1's LoRA targets 7 B of its DiT's 8.8 B parameters
    moved = sorted(k.split(".lora_")[0] + ".weight" for k, v in lora.items() if ".lora_B." in k and v.any())[:4]
    before = {k: v.clone() for k, v in model.state_dict().items() if k in moved}
    assert len(before) == len(moved) > 0
    pipe.load_lora(model, str(result.last_checkpoint))
    changed = [k for k, v in model.state_dict().items() if k in before and not torch.equal(v, before[k])]
    assert changed, "DiffSynth's load_lora left the model as it was"


@pytest.mark.parametrize("world", ["stable_diffusion"], indirect=True)
def test_a_pickled_model_file_is_read_from_its_safetensors_twin(world, tmp_path):
    """--model_paths naming `.pth` files (torch.save pickles of the world's models, each with its config.json): one
    line naming the command that writes the twin; once `write_twin` (that command) has run, each is read from its
    twin, recognised as the same table entry as the safetensors original."""
    import json

    from unitgraph.backends.diffusion.models.twin import write_twin

    root, flags = world
    setup = ds_run.setup(_args(root, flags))
    paths = []
    for index, model in enumerate(setup.models):
        original = Path(model.path)
        pickle = tmp_path / str(index) / f"{original.stem}.pth"
        pickle.parent.mkdir()
        shutil.copy(original.parent / "config.json", pickle.parent / "config.json")
        torch.save(load_file(str(original)), str(pickle))
        paths.append(str(pickle))
    args = _args(root, flags, model_id_with_origin_paths=None, model_paths=json.dumps(paths))
    with pytest.raises(BackendError, match=r"0/.*\.pth: a pickle \(torch.save\), .* once: unitgraph twin /"):
        ds_run.setup(args)
    for path in paths:
        write_twin(path)
    again = ds_run.setup(args)
    assert [m.path for m in again.models] == [str(Path(p).with_suffix(".safetensors")) for p in paths]
    def entries(models):
        return [[(a, e["model_class"], e["model_hash"]) for a, e in m.loads] for m in models]

    assert entries(again.models) == entries(setup.models) and all(entries(setup.models))


def test_a_unit_doing_more_than_it_declares_stops_stage_1(world, tmp_path, monkeypatch):
    from diffsynth.pipelines import stable_diffusion as sd

    root, flags = world
    if flags["module"] != "stable_diffusion":
        pytest.skip("one pipeline's units are enough to show the checks")
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

    def reads(self, pipe, **kwargs):
        assert pipe.unet.in_channels == 4  # what the model is: its skeleton answers
        return original(self, pipe, **kwargs)

    monkeypatch.setattr(sd.SDUnit_ShapeChecker, "process", reads)
    run(_args(root, flags, task="sft:data_process", output_path=str(tmp_path / "c3")))

    def calls(self, pipe, **kwargs):
        pipe.unet.conv_in(torch.zeros(1, 4, 4, 4))  # a model the unit does not name, which stage 1 does not load
        return original(self, pipe, **kwargs)

    monkeypatch.setattr(sd.SDUnit_ShapeChecker, "process", calls)
    with pytest.raises(BackendError, match="unit ShapeChecker calls the model unet"):
        run(_args(root, flags, task="sft:data_process", output_path=str(tmp_path / "c4")))


def test_bad_commands_are_one_line(world, tmp_path):
    root, flags = world
    with pytest.raises(BackendError, match="--blocks_to_swap is not available yet"):
        run(_args(root, flags, blocks_to_swap=2, output_path=str(tmp_path / "x")))
    with pytest.raises(BackendError, match="--caption_dropout must be a probability between 0 and 1, got 1.5"):
        run(_args(root, flags, caption_dropout=1.5, output_path=str(tmp_path / "x")))
    if flags["module"] != "stable_diffusion":
        return
    with pytest.raises(BackendError, match="not trained through DiffSynth's own code yet"):
        run(_args(root, flags, pipeline="diffsynth:minimax_h3_audio_video", output_path=str(tmp_path / "x")))
    for flag, value in (("noise_scale", 7.5), ("processor_config", "HiDream-ai/HiDream-O1-Image-Dev:./")):
        with pytest.raises(BackendError, match=f"--{flag}: diffsynth:stable_diffusion.* no such"):
            run(_args(root, flags, **{flag: value}, output_path=str(tmp_path / "x")))
    with pytest.raises(BackendError, match="--processor_path: diffsynth:stable_diffusion takes no such tokenizer"):
        run(_args(root, flags, processor_path="Qwen/Qwen3-VL-4B-Instruct:", output_path=str(tmp_path / "x")))
    with pytest.raises(BackendError, match="--fp8_models: diffsynth:stable_diffusion trains in float32"):
        run(_args(root, flags, fp8_models="unet", output_path=str(tmp_path / "x")))
    with pytest.raises(BackendError, match="matches no module|not found"):
        run(_args(root, flags, lora_target_modules="nope", output_path=str(tmp_path / "x")))
    with pytest.raises(BackendError, match="no cache of stage 1 here"):
        run(_args(root, flags, task="sft:train", dataset_base_path=str(tmp_path), output_path=str(tmp_path / "x")))
    with pytest.raises(BackendError, match="--frame_rate: diffsynth:stable_diffusion's example reads no clip"):
        run(_args(root, flags, frame_rate=24, output_path=str(tmp_path / "x")))
    with pytest.raises(BackendError, match="--validation_image: diffsynth:stable_diffusion draws its validation "
                                           "samples from the prompt alone"):
        run(_args(root, flags, validation_prompt=["x"], validation_image=["x.png"], output_path=str(tmp_path / "x")))


@pytest.mark.parametrize("world", ["mova_audio_video"], indirect=True)
def test_mova_validation_clips_are_drawn_from_their_first_frame_with_sound(world, tmp_path):
    """--validation_prompt with --validation_image on MOVA: stage 2 draws each prompt's clip through the pipeline's
    own `__call__` from its first frame, the encoders and VAEs loaded for the while from the files the command names,
    and writes it as an mp4 with its sound track (the audio VAE's rate); drawing changes no training step."""
    from unitgraph.backends.diffusion.data.audio import probe_audio
    from unitgraph.backends.diffusion.data.video import read_clip

    root, flags = world
    plain = run(_args(root, flags, num_epochs=1, output_path=str(tmp_path / "plain")))
    drawn = run(_args(root, flags, num_epochs=1, output_path=str(tmp_path / "drawn"), validation_prompt=["a tone"],
                      validation_image=[str(root / "data" / "images" / "000.png")], validation_inference_steps=2))
    assert plain.losses == drawn.losses and same_file_tensors(plain.last_checkpoint, drawn.last_checkpoint)
    clip = tmp_path / "drawn" / "samples" / "epoch-0" / "0.mp4"
    assert probe_audio(clip) == 8000 and len(read_clip(clip, 81)) == 5
    with pytest.raises(BackendError, match="--validation_image: no such file"):
        run(_args(root, flags, num_epochs=1, output_path=str(tmp_path / "x"), validation_prompt=["a tone"],
                  validation_image=[str(root / "nope.png")]))


@pytest.mark.parametrize("world", ["joyai_image"], indirect=True)
def test_joyai_validation_edits_are_diffsynths_own_drawing_and_its_commands_need_the_picture(world, tmp_path):
    """JoyAI-Image edits only: --validation_prompt with --validation_image draws the edit of that picture through the
    pipeline's own `__call__` (its `edit_image`), equal to DiffSynth's drawing with the checkpoint in the LoRA layers
    of its training module (its --lora_checkpoint: in bf16, load_lora's fusing into the weights rounds otherwise), and
    changes no step; a command without the picture column, or a prompt without its picture, is one line (DiffSynth's
    prompt unit would raise NotImplementedError)."""
    import numpy as np
    from diffsynth.core import ModelConfig
    from diffsynth.diffusion.training_module import DiffusionTrainingModule
    from PIL import Image

    root, flags = world
    picture = root / "data" / "images" / "000.png"
    common = dict(num_epochs=1, learning_rate=1e-2)
    with pytest.raises(BackendError, match=r"trains edits only .* --extra_inputs edit_image"):
        run(_args(root, flags, extra_inputs=None, output_path=str(tmp_path / "x"), **common))
    with pytest.raises(BackendError, match=r"trains edits only"):
        run(_args(root, flags, data_file_keys="image", output_path=str(tmp_path / "x"), **common))
    ds_run.check_flags(_args(root, flags, task="sft:train", extra_inputs=None, data_file_keys=None))  # reads a cache
    with pytest.raises(BackendError, match=r"--validation_prompt: diffsynth:joyai_image draws an edit of a picture"):
        run(_args(root, flags, validation_prompt=["make it blue"], output_path=str(tmp_path / "x"), **common))
    assert not (tmp_path / "x").exists()
    plain = run(_args(root, flags, output_path=str(tmp_path / "plain"), **common))
    drawn = run(_args(root, flags, output_path=str(tmp_path / "drawn"), validation_prompt=["make it blue"],
                      validation_image=[str(picture)], validation_inference_steps=2, **common))
    assert plain.losses == drawn.losses and same_file_tensors(plain.last_checkpoint, drawn.last_checkpoint)
    sample = tmp_path / "drawn" / "samples" / "epoch-0" / "0.png"
    assert drawn.sample_images == [sample]
    del plain, drawn
    setup = ds_run.setup(_args(root, flags))
    tokenizers = {k: ModelConfig(path=v) for k, v in
                  setup.tokenizers_for([t.encoder for t in setup.glue.tokenizers]).items()}
    module = DiffusionTrainingModule()
    pipe = module.pipe = setup.pipe_class.from_pretrained(
        torch_dtype=torch.bfloat16, device="cpu", **tokenizers,
        model_configs=[ModelConfig(path=released_file(m.path)) for m in setup.models])
    base_model, targets, _prefix = PIPELINES[flags["module"]]
    checkpoint = str(tmp_path / "drawn" / "epoch-0.safetensors")
    module.switch_pipe_to_training_mode(pipe, None, base_model, targets, 4, checkpoint, None, None, task="sft")
    pipe.eval()
    theirs = pipe(prompt="make it blue", edit_image=Image.open(picture).convert("RGB"), height=32, width=32, seed=3,
                  num_inference_steps=2)
    assert np.array_equal(np.asarray(theirs), np.asarray(Image.open(sample)))


@pytest.mark.parametrize("world", ["mova_audio_video"], indirect=True)
def test_mova_refuses_what_it_cannot_train_as_its_example_does_in_one_line(world, tmp_path):
    """MOVA's sound: a row whose clip has no sound track stops the run naming the row and file (DiffSynth would train
    that clip without sound, unlike the others, and its own split then fails); its loss is DiffSynth's
    FlowMatchSFTAudioVideoLoss, so the samplings and weightings of FlowMatchSFTLoss are refused; nothing is written."""
    import csv

    from unitgraph.backends.diffusion.data.video import write_clip
    from PIL import Image

    root, flags = world
    with pytest.raises(BackendError, match="--timestep_sampling logit_normal: diffsynth:mova_audio_video trains "
                                           "DiffSynth's own FlowMatchSFTAudioVideoLoss"):
        run(_args(root, flags, timestep_sampling="logit_normal", output_path=str(tmp_path / "x")))
    with pytest.raises(BackendError, match="--validation_prompt: diffsynth:mova_audio_video draws a clip from its "
                                           "first frame; give each prompt its frame with --validation_image"):
        run(_args(root, flags, validation_prompt=["a tone"], output_path=str(tmp_path / "x")))
    data = tmp_path / "data"
    shutil.copytree(root / "data", data)
    write_clip(data / "images" / "silent.mp4", [Image.new("RGB", (40, 40), (200, 30, 30))] * 5)
    with open(data / "metadata.csv", newline="", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    rows[1]["input_audio"] = "images/silent.mp4"
    with open(data / "metadata.csv", "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    with pytest.raises(BackendError, match="row 2: 'silent.mp4' \\(column 'input_audio'\\) has no sound track"):
        run(_args(root, flags, dataset_base_path=str(data), dataset_metadata_path=str(data / "metadata.csv"),
                  task="sft:data_process", output_path=str(tmp_path / "cache")))
    assert not (tmp_path / "cache" / ds_run.MANIFEST).exists()


def _with_rows(root: Path, tmp_path: Path, change) -> Path:
    """A copy of the world's song dataset whose metadata.json rows `change(rows)` edits; its folder."""
    data = tmp_path / "songs"
    shutil.copytree(root / "data", data)
    rows = json.loads((data / "metadata.json").read_text(encoding="utf-8"))
    change(rows)
    (data / "metadata.json").write_text(json.dumps(rows), encoding="utf-8")
    return data


@pytest.mark.parametrize("world", ["ace_step"], indirect=True)
def test_ace_step_songs_are_cut_drawn_and_refused_in_one_line(world, tmp_path):
    """ACE-Step's songs: --max_audio_duration trains each song's beginning (its step DiffSynth's own on the song its
    LoadPureAudioWithTorchaudio cuts); --validation_prompt draws a song through the pipeline's `__call__`, written as a
    WAV at 48 kHz, without changing a step; a row without a sound track, a song longer than 600 s without the flag,
    and flags that size pictures or apply to images only are each one line, before anything is cached."""
    import wave

    from diffsynth.core import ModelConfig

    from unitgraph.backends.diffusion.data.audio import wav_bytes
    from unitgraph.backends.diffusion.data.video import write_clip
    from PIL import Image

    root, flags = world
    base_model, targets, _prefix = PIPELINES["ace_step"]
    # --max_audio_duration 1: the first second of each song, as DiffSynth's operator cuts it
    args = _args(root, flags, max_audio_duration=1)
    setup = ds_run.setup(args)
    ours, ours_grads, seed = our_unsplit_step(setup, args, base_model)
    module = diffsynths_module(setup, [ModelConfig(path=m.path) for m in setup.models], base_model, targets, args.seed)
    inputs = ace_step_inputs(str(root / "data"), str(root / "data" / "metadata.json"), module.pipe.device, 1,
                             max_audio_duration=1)
    assert inputs[0]["input_audio"][0].shape == (2, 48000) and inputs[0]["duration"] == 1
    theirs, theirs_grads = diffsynths_step(module, inputs, seed, base_model)
    assert_same_step(ours, ours_grads, theirs, theirs_grads)

    plain = run(_args(root, flags, num_epochs=1, output_path=str(tmp_path / "plain")))
    drawn = run(_args(root, flags, num_epochs=1, output_path=str(tmp_path / "drawn"), validation_prompt=["a tone"],
                      validation_inference_steps=2))
    assert plain.losses == drawn.losses and same_file_tensors(plain.last_checkpoint, drawn.last_checkpoint)
    with wave.open(str(tmp_path / "drawn" / "samples" / "epoch-0" / "0.wav")) as song:
        assert song.getframerate() == 48000 and song.getnchannels() == 2 and song.getnframes() == 60 * 48000
    assert "<audio controls" in (tmp_path / "drawn" / "samples.html").read_text(encoding="utf-8")

    write_clip(tmp_path / "silent.mp4", [Image.new("RGB", (16, 16))] * 2)
    data = _with_rows(root, tmp_path, lambda rows: rows[1].update(audio="../silent.mp4"))
    with pytest.raises(BackendError, match="row 2: 'silent.mp4' \\(column 'audio'\\) has no sound track; "
                                           "diffsynth:ace_step trains on a song"):
        run(_args(root, flags, dataset_base_path=str(data), dataset_metadata_path=str(data / "metadata.json"),
                  task="sft:data_process", output_path=str(tmp_path / "cache")))
    assert not (tmp_path / "cache" / ds_run.MANIFEST).exists()
    shutil.rmtree(data)
    import numpy as np
    # the interrupted stage 1's folder (the first row's entry) is its own: the next one reuses the entry
    again = run(_args(root, flags, task="sft:data_process", output_path=str(tmp_path / "cache")))
    assert (again.entries_reused, again.entries_computed) == (1, 2)

    (tmp_path / "long.wav").write_bytes(wav_bytes(np.zeros((1, 601 * 1000), np.float32), 1000))  # 601 s, 1.2 MB
    (tmp_path / "short.wav").write_bytes(wav_bytes(np.zeros((1, 900), np.float32), 1000))  # 0.9 s
    for name, said in (("long.wav", "is longer than 600 s"), ("short.wav", "is shorter than a second \\(0.90 s\\)")):
        data = _with_rows(root, tmp_path, lambda rows: rows[0].update(audio=f"../{name}"))
        with pytest.raises(BackendError, match=f"row 1: '{name}' \\(column 'audio'\\) {said}"):
            run(_args(root, flags, dataset_base_path=str(data), dataset_metadata_path=str(data / "metadata.json"),
                      task="sft:data_process", output_path=str(tmp_path / "cache")))
        shutil.rmtree(data)
    for over, said in (({"height": 32, "width": 32}, "--height, --width and --max_pixels size pictures"),
                       ({"masked_loss": True}, "--masked_loss: diffsynth:ace_step trains on songs"),
                       ({"max_audio_duration": 0.5}, "--max_audio_duration 0.5: the seconds of a song trained, "
                                                     "at least 1"),
                       ({"silence_latent_path": str(tmp_path / "nope.pt")}, "file not found \\(--silence_latent_path\\)")):
        with pytest.raises(BackendError, match=said):
            run(_args(root, flags, output_path=str(tmp_path / "x"), **over))
    assert not (tmp_path / "x").exists()


IDEOGRAM4_COMMAND = r"""
accelerate launch examples/ideogram4/model_training/train.py \
    --learning_rate 1e-4 \
    --num_epochs 5 \
    --lora_rank 32 \
    --use_gradient_checkpointing \
    --find_unused_parameters \
    --dataset_base_path "./data/diffsynth_example_dataset/ideogram4/Ideogram-4-bf16-repackage" \
    --dataset_metadata_path "./data/diffsynth_example_dataset/ideogram4/Ideogram-4-bf16-repackage/metadata.json" \
    --model_id_with_origin_paths "DiffSynth-Studio/ideogram-4-bf16-repackage:transformer/diffusion_pytorch_model.safetensors,DiffSynth-Studio/ideogram-4-bf16-repackage:text_encoder/model.safetensors,DiffSynth-Studio/ideogram-4-bf16-repackage:vae/diffusion_pytorch_model.safetensors" \
    --lora_base_model "dit" \
    --remove_prefix_in_ckpt "pipe.dit." \
    --max_pixels 1048576 \
    --dataset_repeat 100 \
    --output_path "./models/train/Ideogram-4-bf16-repackage_lora" \
    --lora_target_modules "attention.qkv,attention.o,feed_forward.w1,feed_forward.w2,feed_forward.w3,adaln_modulation" \
    --data_file_keys "image"
"""


def test_diffsynths_ideogram4_lora_command_runs_as_it_is(tmp_path, monkeypatch, capsys):
    """DiffSynth's examples/ideogram4/model_training/lora/Ideogram-4-bf16-repackage.sh with `unitgraph train` for
    `accelerate launch .../train.py`; only sizes are lowered (--num_epochs, --dataset_repeat). The models sit where
    DiffSynth downloads them (./models/<org>/<name>/, its tokenizer at the model id its train.py defaults to), no
    variable is set, and the model id alone chooses DiffSynth's own pipeline."""
    import json

    from clitools import cli

    monkeypatch.chdir(tmp_path)
    for name in ("DIFFSYNTH_MODEL_BASE_PATH", "DIFFSYNTH_SKIP_DOWNLOAD"):
        monkeypatch.delenv(name, raising=False)
    write_tiny_models(tmp_path / "models", "ideogram4")
    data = tmp_path / "data" / "diffsynth_example_dataset" / "ideogram4" / "Ideogram-4-bf16-repackage"
    write_synthetic_dataset(data, count=2, size=40)
    import csv

    with open(data / "metadata.csv", newline="", encoding="utf-8") as handle:
        rows = list(csv.DictReader(handle))
    (data / "metadata.json").write_text(json.dumps(rows), encoding="utf-8")
    argv = shlex_argv(IDEOGRAM4_COMMAND)
    argv[argv.index("--num_epochs") + 1] = "1"
    argv[argv.index("--dataset_repeat") + 1] = "2"
    code, out, err = cli(capsys, "train", *argv)
    assert code == 0, err
    assert "pipeline: diffsynth:ideogram4 (DiffSynth's Ideogram4Pipeline; the model id names Ideogram 4)" in out
    lora = load_file(str(tmp_path / "models" / "train" / "Ideogram-4-bf16-repackage_lora" / "epoch-0.safetensors"))
    assert any(".adaln_modulation.lora_A." in k for k in lora) and not any(k.startswith("pipe.") for k in lora)
    assert "training: 4 steps" in out


def test_the_dry_run_counts_what_the_run_loads_and_trains(world, tmp_path):
    """At test size, with the files here: each model's parameters are its file's, and the LoRA the plan counts is
    the LoRA the run writes."""
    from safetensors import safe_open

    root, flags = world
    plan = run(_args(root, flags, dry_run=True, output_path=str(tmp_path / "dry"))).memory_plan
    trained = run(_args(root, flags, num_epochs=1, output_path=str(tmp_path / "out")))
    lora = load_file(str(trained.last_checkpoint))
    assert plan["stages"]["train"]["trained_params"] == sum(t.numel() for t in lora.values())
    width = 4 if setup_dtype(flags) == "float32" else 2
    setup = ds_run.setup(_args(root, flags))
    for model in setup.models:
        with safe_open(str(model.path), "pt") as handle:
            numel = sum(int(torch.tensor(handle.get_slice(k).get_shape()).prod()) for k in handle.keys())
        counted = sum(plan["models"][a]["params"] for a in model.attributes)  # a VAE file: encoder and decoder
        assert counted == numel, model.attributes
        assert all(plan["models"][a]["bytes"] == plan["models"][a]["params"] * width for a in model.attributes)
    stages = plan["stages"]
    assert stages["unsplit"]["weights"] == stages["data_process"]["weights"] + stages["train"]["weights"]
    assert not (tmp_path / "dry").exists()
    n = stages["train"]["trained_params"]
    assert stages["train"]["optimizer"] == 8 * n and stages["train"]["ema"] == 0  # AdamW's two fp32 moments
    if flags["module"] != "stable_diffusion":
        return
    # the recipe: Adafactor's own state (its factored second moment) as a run keeps it, the average's fp32 copy
    recipe = dict(optimizer="adafactor", ema_decay=0.9, num_epochs=1)
    planned = run(_args(root, flags, dry_run=True, output_path=str(tmp_path / "dry"), **recipe)).memory_plan
    run(_args(root, flags, output_path=str(tmp_path / "recipe"), **recipe))
    kept = load_file(str(next((tmp_path / "recipe" / "state").iterdir()) / "optimizer.safetensors"))
    held = sum(t.numel() * t.element_size() for t in kept.values() if t.dim() > 0)  # (step counts: numbers)
    train = planned["stages"]["train"]
    assert train["optimizer"] == held < 8 * n and train["ema"] == 4 * n
    assert train["total"] == stages["train"]["total"] - 8 * n + held + 4 * n
    offloaded = run(_args(root, flags, dry_run=True, ema_device="cpu", **recipe)).memory_plan["stages"]["train"]
    assert offloaded["ema"] == 0 and offloaded["host"] == train["host"] + 4 * n


def setup_dtype(flags: dict) -> str:
    from unitgraph.backends.diffusion.diffsynth_source.glue import glue_for

    return glue_for(flags["module"]).dtype


def test_the_dry_run_of_the_released_ideogram4_needs_no_file(tmp_path, monkeypatch, capsys):
    """DiffSynth's Ideogram 4 command, --dry_run, in a folder with nothing downloaded: the released sizes from
    DiffSynth's table (the bf16 repackage's text encoder and VAE sized as the releases its table names), no network."""
    from clitools import cli

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("DIFFSYNTH_SKIP_DOWNLOAD", "True")
    monkeypatch.delenv("DIFFSYNTH_MODEL_BASE_PATH", raising=False)  # a module fixture's tiny ./models may be set
    argv = shlex_argv(IDEOGRAM4_COMMAND)
    code, out, err = cli(capsys, "train", *argv, "--dry_run", "--json")
    assert code == 0, err
    import json

    plan = json.loads(out[out.index("{"):])
    models = plan["models"]
    assert 9.0e9 < models["dit"]["params"] < 9.5e9 and 7.5e9 < models["text_encoder"]["params"] < 8.5e9
    stages = plan["stages"]
    # the text encoder and the VAE go to stage 1 (the image unit narrowed to input_latents: planning.py)
    assert stages["data_process"]["models"] == ["text_encoder", "vae"] and stages["train"]["models"] == ["dit"]
    assert (stages["unsplit"]["total"] - stages["train"]["total"]
            == models["text_encoder"]["bytes"] + models["vae"]["bytes"])
    assert not (tmp_path / "models").exists()


# examples/anima/model_training/lora/anima-preview.sh, as it is
ANIMA_COMMAND = r"""
accelerate launch examples/anima/model_training/train.py \
  --dataset_base_path data/diffsynth_example_dataset/anima/anima-preview \
  --dataset_metadata_path data/diffsynth_example_dataset/anima/anima-preview/metadata.csv \
  --max_pixels 1048576 \
  --dataset_repeat 50 \
  --model_id_with_origin_paths "circlestone-labs/Anima:split_files/diffusion_models/anima-preview.safetensors,circlestone-labs/Anima:split_files/text_encoders/qwen_3_06b_base.safetensors,circlestone-labs/Anima:split_files/vae/qwen_image_vae.safetensors" \
  --tokenizer_path "Qwen/Qwen3-0.6B:./" \
  --tokenizer_t5xxl_path "stabilityai/stable-diffusion-3.5-large:tokenizer_3/" \
  --learning_rate 1e-4 \
  --num_epochs 5 \
  --remove_prefix_in_ckpt "pipe.dit." \
  --output_path "./models/train/anima-preview_lora" \
  --lora_base_model "dit" \
  --lora_target_modules "" \
  --lora_rank 32 \
  --use_gradient_checkpointing
"""


def test_diffsynths_anima_lora_command_runs_as_it_is(tmp_path, monkeypatch, capsys):
    """DiffSynth's examples/anima/model_training/lora/anima-preview.sh with `unitgraph train` for `accelerate launch
    .../train.py`; only sizes are lowered (--num_epochs 1, --dataset_repeat 1, two 32 px images). The model ids alone
    choose DiffSynth's own pipeline; its tokenizers are found where its example names them (Qwen3's at the root of
    Qwen/Qwen3-0.6B, `./`); `--lora_target_modules ""` is DiffSynth's auto-detection, which at the DiT's only size
    finds the Linear layers of its 28 blocks."""
    from clitools import cli

    monkeypatch.chdir(tmp_path)
    for name in ("DIFFSYNTH_MODEL_BASE_PATH", "DIFFSYNTH_SKIP_DOWNLOAD"):
        monkeypatch.delenv(name, raising=False)
    write_tiny_models(tmp_path / "models", "anima_image")
    write_synthetic_dataset(tmp_path / "data" / "diffsynth_example_dataset" / "anima" / "anima-preview", count=2,
                            size=32)
    argv = shlex_argv(ANIMA_COMMAND)
    argv[argv.index("--num_epochs") + 1] = "1"
    argv[argv.index("--dataset_repeat") + 1] = "1"
    code, out, err = cli(capsys, "train", *argv)
    assert code == 0, err
    assert "pipeline: diffsynth:anima_image (DiffSynth's AnimaImagePipeline; the model id names Anima)" in out, out
    lora = load_file(str(tmp_path / "models" / "train" / "anima-preview_lora" / "epoch-0.safetensors"))
    blocks = {k.split(".")[1] for k in lora if k.startswith("blocks.")}
    assert len(blocks) == 28 and not any(k.startswith("pipe.") for k in lora)
    assert {v.shape[0] for k, v in lora.items() if ".lora_A." in k} == {32}
    assert "training: 2 steps" in out


def ported(command: str, module: str, tmp_path: Path, monkeypatch, videos: tuple = (), frames: int = 5,
           audio: bool = False, edit: bool = False, size: int = 32, **lowered: str) -> list[str]:
    """The flags of a DiffSynth example's command, to run in `tmp_path` as the folder it is launched from: the
    pipeline's tiny ./models written there, two `size` px samples (clips: `videos`, with a sound track and an input_audio
    column: `audio`; with an edit_image column: `edit`) where its --dataset_base_path points, downloads not turned off
    (the files are where the command looks), --num_epochs and --dataset_repeat 1 and the `lowered` flags
    (`{"--height": "32"}`) set."""
    monkeypatch.chdir(tmp_path)
    for name in ("DIFFSYNTH_MODEL_BASE_PATH", "DIFFSYNTH_SKIP_DOWNLOAD"):
        monkeypatch.delenv(name, raising=False)
    write_tiny_models(tmp_path / "models", module)
    argv = shlex_argv(command)
    write_synthetic_dataset(tmp_path / argv[argv.index("--dataset_base_path") + 1], count=2, size=size, edit=edit,
                            **({"videos": videos, "frames": frames, "audio": audio} if videos else {}))
    for flag, value in {"--num_epochs": "1", "--dataset_repeat": "1", **lowered}.items():
        argv[argv.index(flag) + 1] = value
    return argv


# examples/ernie_image/model_training/lora/ERNIE-Image.sh, as it is
ERNIE_IMAGE_COMMAND = r"""
accelerate launch examples/ernie_image/model_training/train.py \
  --dataset_base_path data/diffsynth_example_dataset/ernie_image/Ernie-Image-T2I \
  --dataset_metadata_path data/diffsynth_example_dataset/ernie_image/Ernie-Image-T2I/metadata.csv \
  --max_pixels 1048576 \
  --dataset_repeat 50 \
  --model_id_with_origin_paths "PaddlePaddle/ERNIE-Image:transformer/diffusion_pytorch_model*.safetensors,PaddlePaddle/ERNIE-Image:text_encoder/model.safetensors,PaddlePaddle/ERNIE-Image:vae/diffusion_pytorch_model.safetensors" \
  --learning_rate 1e-4 \
  --num_epochs 5 \
  --remove_prefix_in_ckpt "pipe.dit." \
  --output_path "./models/train/Ernie-Image-T2I_lora" \
  --lora_base_model "dit" \
  --lora_target_modules "to_q,to_k,to_v,to_out.0" \
  --lora_rank 32 \
  --use_gradient_checkpointing \
  --dataset_num_workers 8 \
  --find_unused_parameters
"""


def test_diffsynths_ernie_image_lora_command_runs_as_it_is(tmp_path, monkeypatch, capsys):
    """DiffSynth's examples/ernie_image/model_training/lora/ERNIE-Image.sh with `unitgraph train` for `accelerate
    launch .../train.py`; only sizes are lowered (--num_epochs 1, --dataset_repeat 1, two 32 px images). The model ids
    alone choose DiffSynth's own pipeline; the DiT's shards are found by the command's glob, the tokenizer where its
    train.py looks by default (PaddlePaddle/ERNIE-Image/tokenizer); the released-size text encoder runs in stage 1."""
    from clitools import cli

    argv = ported(ERNIE_IMAGE_COMMAND, "ernie_image", tmp_path, monkeypatch)
    code, out, err = cli(capsys, "train", *argv)
    assert code == 0, err
    assert "pipeline: diffsynth:ernie_image (DiffSynth's ErnieImagePipeline; the model id names ERNIE-Image)" in out, out
    assert "training: 2 steps" in out
    lora = load_file(str(tmp_path / "models" / "train" / "Ernie-Image-T2I_lora" / "epoch-0.safetensors"))
    assert lora and not any(k.startswith("pipe.") for k in lora)
    assert {k.split(".lora_")[0].rsplit(".", 1)[-1] for k in lora} == {"to_q", "to_k", "to_v", "0"}
    assert {v.shape[0] for k, v in lora.items() if ".lora_A." in k} == {32}


# examples/krea2/model_training/lora/Krea-2-Raw.sh, as it is
KREA2_COMMAND = r"""
accelerate launch examples/krea2/model_training/train.py \
  --dataset_base_path data/diffsynth_example_dataset/krea2/Krea-2-Raw \
  --dataset_metadata_path data/diffsynth_example_dataset/krea2/Krea-2-Raw/metadata.csv \
  --max_pixels 1048576 \
  --dataset_repeat 50 \
  --model_id_with_origin_paths "krea/Krea-2-Raw:raw.safetensors,Qwen/Qwen3-VL-4B-Instruct:*.safetensors,Qwen/Qwen-Image:vae/diffusion_pytorch_model.safetensors" \
  --tokenizer_path "Qwen/Qwen3-VL-4B-Instruct:" \
  --learning_rate 1e-4 \
  --num_epochs 5 \
  --remove_prefix_in_ckpt "pipe.dit." \
  --output_path "./models/train/Krea-2-Raw_lora" \
  --lora_base_model "dit" \
  --lora_target_modules "wq,wk,wv,gate,wo,gate,up,down,first,tmlp.0,tmlp.2,projector,txtmlp.1,txtmlp.3,last.linear,tproj.1" \
  --lora_rank 32 \
  --use_gradient_checkpointing \
  --find_unused_parameters \
  --align_to_opensource_format
"""


def test_diffsynths_krea2_lora_command_runs_as_it_is(tmp_path, monkeypatch, capsys):
    """DiffSynth's examples/krea2/model_training/lora/Krea-2-Raw.sh with `unitgraph train` for `accelerate launch
    .../train.py`; only sizes are lowered (--num_epochs 1, --dataset_repeat 1, two 32 px images). The model ids alone
    choose DiffSynth's own pipeline (Krea 2's id comes first; Qwen-Image's VAE does not make it Qwen-Image); the
    tokenizer is the root of Qwen3-VL's folder (`Qwen/Qwen3-VL-4B-Instruct:`); the LoRA is written in the open-source
    layout (--align_to_opensource_format: DiffSynth's Krea2LoRAConverter). Here on a CPU its DiT's attention runs
    torch's math kernel (any_attention_kernel); without that the run stops before loading anything, in one line."""
    import diffsynth.models.krea2_dit as krea2_dit
    from torch.nn.attention import sdpa_kernel

    from clitools import cli, one_error_line

    argv = ported(KREA2_COMMAND, "krea2", tmp_path, monkeypatch)
    monkeypatch.setattr(krea2_dit, "sdpa_kernel", sdpa_kernel)  # DiffSynth's own choice, whatever fixture is alive
    code, _, err = cli(capsys, "train", *argv)
    one_error_line(code, err, "diffsynth:krea2", "krea2_dit.attention", "(cpu)", "it trains on a CUDA GPU")
    assert not (tmp_path / "models" / "train").exists()
    with any_attention_kernel("krea2"):
        code, out, err = cli(capsys, "train", *argv)
    assert code == 0, err
    assert "pipeline: diffsynth:krea2 (DiffSynth's Krea2Pipeline; the model id names Krea 2)" in out, out
    assert "training: 2 steps" in out
    lora = load_file(str(tmp_path / "models" / "train" / "Krea-2-Raw_lora" / "epoch-0.safetensors"))
    assert lora and all(k.startswith("transformer.") and k.endswith((".lora_A.weight", ".lora_B.weight")) for k in lora)
    assert any(".text_fusion." in k for k in lora) and any(k.startswith("transformer.img_in.") for k in lora)
    assert {v.shape[0] for k, v in lora.items() if ".lora_A." in k} == {32}


# examples/lingbot_video/model_training/lora/lingbot-video-dense-1.3b_t2v.sh, as it is
LINGBOT_VIDEO_COMMAND = r"""
accelerate launch examples/lingbot_video/model_training/train.py \
  --dataset_base_path data/diffsynth_example_dataset/lingbot_video/lingbot-video-dense-1.3b_t2v \
  --dataset_metadata_path data/diffsynth_example_dataset/lingbot_video/lingbot-video-dense-1.3b_t2v/metadata.json \
  --data_file_keys "video" \
  --height 480 \
  --width 832 \
  --num_frames 81 \
  --dataset_repeat 50 \
  --model_id_with_origin_paths "Robbyant/lingbot-video-dense-1.3b:transformer/diffusion_pytorch_model.safetensors,Qwen/Qwen3-VL-4B-Instruct:*.safetensors,Robbyant/lingbot-video-dense-1.3b:vae/diffusion_pytorch_model.safetensors" \
  --processor_path "Qwen/Qwen3-VL-4B-Instruct:" \
  --learning_rate 1e-4 \
  --num_epochs 5 \
  --remove_prefix_in_ckpt "pipe.dit." \
  --output_path "./models/train/lingbot-video-dense-1.3b_t2v_lora" \
  --lora_base_model "dit" \
  --lora_target_modules "to_q,to_k,to_v,to_out" \
  --lora_rank 32 \
  --use_gradient_checkpointing
"""


def test_diffsynths_lingbot_video_lora_command_runs_as_it_is(tmp_path, monkeypatch, capsys):
    """DiffSynth's examples/lingbot_video/model_training/lora/lingbot-video-dense-1.3b_t2v.sh with `unitgraph train`
    for `accelerate launch .../train.py`; only sizes are lowered (--height and --width 32, --num_frames 5, --num_epochs
    1, --dataset_repeat 1, two clips). Its metadata is a JSON list, as the example's dataset has it; the model ids
    alone choose DiffSynth's own pipeline; `--processor_path` names Qwen3-VL's folder, whose processor reads the
    caption for the text encoder; the clips are read by DiffSynth's video operator."""
    import csv
    import json

    from clitools import cli

    argv = ported(LINGBOT_VIDEO_COMMAND, "lingbot_video", tmp_path, monkeypatch, videos=("video",), frames=5,
                  **{"--height": "32", "--width": "32", "--num_frames": "5"})
    data = tmp_path / argv[argv.index("--dataset_base_path") + 1]
    with open(data / "metadata.csv", newline="", encoding="utf-8") as f:
        rows = [{"video": r["video"], "prompt": r["prompt"]} for r in csv.DictReader(f)]
    (data / "metadata.json").write_text(json.dumps(rows, indent=1), encoding="utf-8")
    code, out, err = cli(capsys, "train", *argv)
    assert code == 0, err
    assert ("pipeline: diffsynth:lingbot_video (DiffSynth's LingBotVideoPipeline; the model id names LingBot-Video)"
            in out), out
    assert "training: 2 steps" in out
    lora = load_file(str(tmp_path / "models" / "train" / "lingbot-video-dense-1.3b_t2v_lora" / "epoch-0.safetensors"))
    assert lora and not any(k.startswith("pipe.") for k in lora)
    assert {k.split(".lora_")[0].rsplit(".", 1)[-1] for k in lora} == {"to_q", "to_k", "to_v", "to_out"}
    assert {v.shape[0] for k, v in lora.items() if ".lora_A." in k} == {32}


# examples/stable_diffusion/model_training/full/stable-diffusion-v1-5.sh and
# examples/stable_diffusion_xl/model_training/full/stable-diffusion-xl-base-1.0.sh, as they are
# examples/mova/model_training/lora/MOVA-360P-I2AV.sh, its two commands as they are: the high-noise expert's LoRA, then
# the low-noise one's
MOVA_COMMANDS = [r"""
accelerate launch examples/mova/model_training/train.py \
  --dataset_base_path data/diffsynth_example_dataset/mova/MOVA-360P-I2AV \
  --dataset_metadata_path data/diffsynth_example_dataset/mova/MOVA-360P-I2AV/metadata.csv \
  --data_file_keys "video,input_audio" \
  --extra_inputs "input_audio,input_image" \
  --height 352 \
  --width 640 \
  --num_frames 121 \
  --dataset_repeat 100 \
  --model_id_with_origin_paths "openmoss/MOVA-360p:%s/diffusion_pytorch_model-*.safetensors,openmoss/MOVA-360p:audio_dit/diffusion_pytorch_model.safetensors,openmoss/MOVA-360p:dual_tower_bridge/diffusion_pytorch_model.safetensors,openmoss/MOVA-720p:audio_vae/diffusion_pytorch_model.safetensors,DiffSynth-Studio/Wan-Series-Converted-Safetensors:Wan2.1_VAE.safetensors,DiffSynth-Studio/Wan-Series-Converted-Safetensors:models_t5_umt5-xxl-enc-bf16.safetensors" \
  --learning_rate 1e-4 \
  --num_epochs 5 \
  --remove_prefix_in_ckpt "pipe.video_dit." \
  --output_path "./models/train/MOVA-360p-I2AV_%s_lora" \
  --lora_base_model "video_dit" \
  --lora_target_modules "q,k,v,o,ffn.0,ffn.2" \
  --lora_rank 32 \
  --max_timestep_boundary %s \
  --min_timestep_boundary %s \
  --use_gradient_checkpointing
""" % expert for expert in (("video_dit", "high_noise", "0.358", "0"), ("video_dit_2", "low_noise", "1", "0.358"))]


def test_diffsynths_mova_lora_commands_run_as_they_are(tmp_path, monkeypatch, capsys):
    """DiffSynth's examples/mova/model_training/lora/MOVA-360P-I2AV.sh, both commands (the high- and the low-noise
    expert), with `unitgraph train` for `accelerate launch .../train.py`; only sizes are lowered (--height and --width
    32, --num_frames 5, --num_epochs 1, --dataset_repeat 1, two clips with a sound track). The model ids alone choose
    DiffSynth's own pipeline; the clips are read at 24 fps by DiffSynth's video operator, their sound by its
    LoadAudioWithTorchaudio handed PyAV's decoder, and the audio VAE runs in stage 1; the tokenizer is looked for
    where its train.py looks by default. Each expert's LoRA is written in DiffSynth's layout."""
    from clitools import cli

    for command in MOVA_COMMANDS:
        argv = ported(command, "mova_audio_video", tmp_path, monkeypatch, videos=("video",), frames=5, audio=True,
                      **{"--height": "32", "--width": "32", "--num_frames": "5"})
        code, out, err = cli(capsys, "train", *argv)
        assert code == 0, err
        assert ("pipeline: diffsynth:mova_audio_video (DiffSynth's MovaAudioVideoPipeline; the model id names MOVA)"
                in out), out
        plan = next(line for line in out.splitlines() if line.startswith("plan:"))
        assert "InputAudioEmbedder" in plan.split("stage 2")[0] and "audio_vae" in plan.split("stage 2")[0], plan
        assert "training: 2 steps" in out
        lora = load_file(str(tmp_path / argv[argv.index("--output_path") + 1] / "epoch-0.safetensors"))
        assert lora and all(k.startswith("blocks.") and k.endswith((".lora_A.default.weight", ".lora_B.default.weight"))
                            for k in lora), sorted(lora)[:3]
        assert {v.shape[0] for k, v in lora.items() if ".lora_A." in k} == {32}
        assert any(".ffn.2." in k for k in lora) and any(".self_attn.o." in k for k in lora)


# examples/ace_step/model_training/lora/Ace-Step1.5.sh, as it is
ACE_STEP_COMMAND = r"""
accelerate launch examples/ace_step/model_training/train.py \
    --learning_rate 1e-4 \
    --num_epochs 20 \
    --lora_rank 32 \
    --use_gradient_checkpointing \
    --find_unused_parameters \
    --dataset_base_path "./data/diffsynth_example_dataset/ace_step/Ace-Step1.5" \
    --dataset_metadata_path "./data/diffsynth_example_dataset/ace_step/Ace-Step1.5/metadata.json" \
    --model_id_with_origin_paths "ACE-Step/Ace-Step1.5:acestep-v15-turbo/model.safetensors,ACE-Step/Ace-Step1.5:Qwen3-Embedding-0.6B/model.safetensors,ACE-Step/Ace-Step1.5:vae/diffusion_pytorch_model.safetensors" \
    --tokenizer_path "ACE-Step/Ace-Step1.5:Qwen3-Embedding-0.6B/" \
    --silence_latent_path "ACE-Step/Ace-Step1.5:acestep-v15-turbo/silence_latent.pt" \
    --lora_base_model "dit" \
    --remove_prefix_in_ckpt "pipe.dit." \
    --dataset_repeat 50 \
    --output_path "./models/train/Ace-Step1.5_lora" \
    --lora_target_modules "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj" \
    --data_file_keys "audio"
"""


def test_diffsynths_ace_step_lora_command_runs_as_it_is(tmp_path, monkeypatch, capsys):
    """DiffSynth's examples/ace_step/model_training/lora/Ace-Step1.5.sh with `unitgraph train` for `accelerate launch
    .../train.py`; only sizes are lowered (--num_epochs 1, --dataset_repeat 1, two 1.3 s songs). The model ids alone
    choose DiffSynth's own pipeline. The release's silence latent is a `.pt` pickle: alone, it is refused in one line
    that names the command writing its safetensors twin once, and that command writes the twin the run then reads."""
    from clitools import cli

    monkeypatch.chdir(tmp_path)
    for name in ("DIFFSYNTH_MODEL_BASE_PATH", "DIFFSYNTH_SKIP_DOWNLOAD"):
        monkeypatch.delenv(name, raising=False)
    write_tiny_models(tmp_path / "models", "ace_step")
    argv = shlex_argv(ACE_STEP_COMMAND)
    data = tmp_path / argv[argv.index("--dataset_base_path") + 1]
    write_synthetic_dataset(data, count=2, size=32, songs=1.3)
    song_metadata(data)
    for flag, value in {"--num_epochs": "1", "--dataset_repeat": "1"}.items():
        argv[argv.index(flag) + 1] = value
    turbo = tmp_path / "models" / "ACE-Step" / "Ace-Step1.5" / "acestep-v15-turbo"
    (value,) = load_file(str(turbo / "silence_latent.safetensors")).values()
    torch.save(value, str(turbo / "silence_latent.pt"))  # the release's file
    (turbo / "silence_latent.safetensors").unlink()
    code, out, err = cli(capsys, "train", *argv)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "silence_latent.pt: a pickle (torch.save), which unitgraph does not unpickle while it runs" in err, err
    conversion = err.split("beside it once: ", 1)[1].strip()
    # (DiffSynth's ./models, relative to where the command runs)
    assert conversion == f"unitgraph twin {(turbo / 'silence_latent.pt').relative_to(tmp_path)}", conversion
    code, out, err = cli(capsys, *conversion.split()[1:])
    assert code == 0 and "1 tensors of" in out, err
    assert torch.equal(load_file(str(turbo / "silence_latent.safetensors"))["silence_latent"], value)
    code, out, err = cli(capsys, "train", *argv)
    assert code == 0, err
    assert "pipeline: diffsynth:ace_step (DiffSynth's AceStepPipeline; the model id names ACE-Step)" in out, out
    plan = next(line for line in out.splitlines() if line.startswith("plan:"))
    assert "ConditionEmbedder" in plan.split("stage 2")[0] and "conditioner" in plan.split("stage 2")[0], plan
    assert "training: 2 steps" in out
    lora = load_file(str(tmp_path / "models" / "train" / "Ace-Step1.5_lora" / "epoch-0.safetensors"))
    assert lora and all(k.startswith("layers.") for k in lora) and any(".mlp.down_proj." in k for k in lora)
    assert {v.shape[0] for k, v in lora.items() if ".lora_A." in k} == {32}


# examples/qwen_image/model_training/lora/Qwen-Image.sh, as it is
QWEN_IMAGE_COMMAND = r"""
accelerate launch examples/qwen_image/model_training/train.py \
  --dataset_base_path data/diffsynth_example_dataset/qwen_image/Qwen-Image \
  --dataset_metadata_path data/diffsynth_example_dataset/qwen_image/Qwen-Image/metadata.csv \
  --max_pixels 1048576 \
  --dataset_repeat 50 \
  --model_id_with_origin_paths "Qwen/Qwen-Image:transformer/diffusion_pytorch_model*.safetensors,Qwen/Qwen-Image:text_encoder/model*.safetensors,Qwen/Qwen-Image:vae/diffusion_pytorch_model.safetensors" \
  --learning_rate 1e-4 \
  --num_epochs 5 \
  --remove_prefix_in_ckpt "pipe.dit." \
  --output_path "./models/train/Qwen-Image_lora" \
  --lora_base_model "dit" \
  --lora_target_modules "to_q,to_k,to_v,add_q_proj,add_k_proj,add_v_proj,to_out.0,to_add_out,img_mlp.net.2,img_mod.1,txt_mlp.net.2,txt_mod.1" \
  --lora_rank 32 \
  --use_gradient_checkpointing \
  --dataset_num_workers 8 \
  --find_unused_parameters
"""
# the same through DiffSynth's pipeline: the model ids alone choose unitgraph's own Qwen-Image family (the default)
QWEN_IMAGE_DIFFSYNTH = QWEN_IMAGE_COMMAND.rstrip() + " \\\n  --pipeline diffsynth:qwen_image\n"

# examples/qwen_image/model_training/special/split_training/Qwen-Image-LoRA.sh, both commands as they are
QWEN_IMAGE_SPLIT_COMMANDS = r"""
accelerate launch examples/qwen_image/model_training/train.py \
  --dataset_base_path data/diffsynth_example_dataset/qwen_image/Qwen-Image \
  --dataset_metadata_path data/diffsynth_example_dataset/qwen_image/Qwen-Image/metadata.csv \
  --max_pixels 1048576 \
  --dataset_repeat 1 \
  --model_id_with_origin_paths "Qwen/Qwen-Image:text_encoder/model*.safetensors,Qwen/Qwen-Image:vae/diffusion_pytorch_model.safetensors" \
  --learning_rate 1e-4 \
  --num_epochs 5 \
  --remove_prefix_in_ckpt "pipe.dit." \
  --output_path "./models/train/Qwen-Image-LoRA-splited-cache" \
  --lora_base_model "dit" \
  --lora_target_modules "to_q,to_k,to_v,add_q_proj,add_k_proj,add_v_proj,to_out.0,to_add_out,img_mlp.net.2,img_mod.1,txt_mlp.net.2,txt_mod.1" \
  --lora_rank 32 \
  --use_gradient_checkpointing \
  --dataset_num_workers 8 \
  --find_unused_parameters \
  --task "sft:data_process"

accelerate launch examples/qwen_image/model_training/train.py \
  --dataset_base_path "./models/train/Qwen-Image-LoRA-splited-cache" \
  --max_pixels 1048576 \
  --dataset_repeat 50 \
  --model_id_with_origin_paths "Qwen/Qwen-Image:transformer/diffusion_pytorch_model*.safetensors" \
  --learning_rate 1e-4 \
  --num_epochs 5 \
  --remove_prefix_in_ckpt "pipe.dit." \
  --output_path "./models/train/Qwen-Image-LoRA-splited" \
  --lora_base_model "dit" \
  --lora_target_modules "to_q,to_k,to_v,add_q_proj,add_k_proj,add_v_proj,to_out.0,to_add_out,img_mlp.net.2,img_mod.1,txt_mlp.net.2,txt_mod.1" \
  --lora_rank 32 \
  --use_gradient_checkpointing \
  --dataset_num_workers 8 \
  --find_unused_parameters \
  --task "sft:train"
"""


def test_diffsynths_qwen_image_split_training_commands_run_as_they_are(tmp_path, monkeypatch, capsys):
    """DiffSynth's examples/qwen_image/model_training/special/split_training/Qwen-Image-LoRA.sh, both commands, with
    `unitgraph train` for `accelerate launch .../train.py` and `--pipeline diffsynth:qwen_image` (the model ids alone
    choose unitgraph's own Qwen-Image family, the documented default); only sizes are lowered (--num_epochs,
    --dataset_repeat). Its text encoder is the released 8.29 B in the release's four shards, which DiffSynth's table
    knows by their key hash; stage 1 names it and the VAE, stage 2 only the DiT, and trains from the cache with the
    encoder's folder gone. The LoRA is in DiffSynth's layout, rank 32, on the text stream's MLP of the one block too."""
    from clitools import cli

    command_1, command_2 = QWEN_IMAGE_SPLIT_COMMANDS.strip().split("\n\n")
    argv_1, argv_2 = ported(command_1, "qwen_image", tmp_path, monkeypatch), shlex_argv(command_2)
    argv_2[argv_2.index("--num_epochs") + 1] = "1"
    argv_2[argv_2.index("--dataset_repeat") + 1] = "1"
    root = tmp_path / "models" / "Qwen" / "Qwen-Image"
    assert len(list((root / "text_encoder").glob("model-*-of-00004.safetensors"))) == 4
    code, out, err = cli(capsys, "train", *argv_1, "--pipeline", "diffsynth:qwen_image")
    assert code == 0, err
    assert "pipeline: diffsynth:qwen_image (DiffSynth's QwenImagePipeline; --pipeline)" in out, out
    assert "stage 1 runs" in out and "(text_encoder, vae)" in out, out
    shutil.move(str(root / "text_encoder"), str(tmp_path / "gone"))
    try:
        code, out, err = cli(capsys, "train", *argv_2, "--pipeline", "diffsynth:qwen_image")
    finally:
        shutil.move(str(tmp_path / "gone"), str(root / "text_encoder"))
    assert code == 0, err
    assert "stage 2 (train): 2 steps" in out, out
    lora = load_file(str(tmp_path / "models" / "train" / "Qwen-Image-LoRA-splited" / "epoch-0.safetensors"))
    assert not any(k.startswith("pipe.") for k in lora)
    assert any(".txt_mlp.net.2.lora_A." in k for k in lora) and any(".img_mod.1.lora_B." in k for k in lora)
    assert {v.shape[0] for k, v in lora.items() if ".lora_A." in k} == {32}


# examples/boogu_image/model_training/lora/Boogu-Image-0.1-Base.sh, as it is
BOOGU_IMAGE_COMMAND = r"""
accelerate launch examples/boogu_image/model_training/train.py \
  --dataset_base_path "./data/diffsynth_example_dataset/boogu_image/Boogu-Image-0.1-Base" \
  --dataset_metadata_path "./data/diffsynth_example_dataset/boogu_image/Boogu-Image-0.1-Base/metadata.csv" \
  --max_pixels 1048576 \
  --dataset_repeat 50 \
  --model_id_with_origin_paths "Boogu/Boogu-Image-0.1-Base:transformer/*.safetensors,Boogu/Boogu-Image-0.1-Base:mllm/*.safetensors,Boogu/Boogu-Image-0.1-Base:vae/*.safetensors" \
  --learning_rate 1e-4 \
  --num_epochs 5 \
  --remove_prefix_in_ckpt "pipe.dit." \
  --output_path "./models/train/Boogu-Image-0.1-Base_lora" \
  --lora_base_model "dit" \
  --lora_target_modules "to_q,to_k,to_v,to_out.0,img_to_q,img_to_k,img_to_v,img_out,instruct_to_q,instruct_to_k,instruct_to_v,instruct_out" \
  --lora_rank 32 \
  --use_gradient_checkpointing \
  --dataset_num_workers 8 \
  --find_unused_parameters \
  --data_file_keys "image"
"""


def test_diffsynths_boogu_image_lora_command_runs_as_it_is(tmp_path, monkeypatch, capsys):
    """DiffSynth's examples/boogu_image/model_training/lora/Boogu-Image-0.1-Base.sh with `unitgraph train` for
    `accelerate launch .../train.py`; only sizes are lowered (--num_epochs, --dataset_repeat). The model ids alone
    choose DiffSynth's pipeline; its processor is read from the release's mllm/ folder, where its train.py looks by
    default, beside the text encoder's four shards (the released Qwen3-VL 8B, known to DiffSynth's table by its key
    hash); the text encoder and the VAE run in stage 1."""
    from clitools import cli

    argv = ported(BOOGU_IMAGE_COMMAND, "boogu_image", tmp_path, monkeypatch)
    mllm = tmp_path / "models" / "Boogu" / "Boogu-Image-0.1-Base" / "mllm"
    assert len(list(mllm.glob("model-*-of-00004.safetensors"))) == 4 and (mllm / "tokenizer_config.json").is_file()
    code, out, err = cli(capsys, "train", *argv)
    assert code == 0, err
    assert "pipeline: diffsynth:boogu_image (DiffSynth's BooguImagePipeline; the model id names Boogu-Image)" in out, out
    plan = next(line for line in out.splitlines() if line.startswith("plan:"))
    assert "text_encoder" in plan.split("stage 2")[0] and "vae_encoder" in plan.split("stage 2")[0], plan
    assert "training: 2 steps" in out, out
    lora = load_file(str(tmp_path / "models" / "train" / "Boogu-Image-0.1-Base_lora" / "epoch-0.safetensors"))
    assert lora and not any(k.startswith("pipe.") for k in lora)
    assert any(".instruct_to_q.lora_A." in k for k in lora) and any(".img_to_q.lora_B." in k for k in lora)
    assert {v.shape[0] for k, v in lora.items() if ".lora_A." in k} == {32}


# examples/joyai_image/model_training/lora/JoyAI-Image-Edit.sh, as it is (its two commands: stage 1, then stage 2)
JOYAI_IMAGE_COMMANDS = r"""
accelerate launch examples/joyai_image/model_training/train.py \
    --dataset_base_path "./data/diffsynth_example_dataset/joyai_image/JoyAI-Image-Edit" \
    --dataset_metadata_path "./data/diffsynth_example_dataset/joyai_image/JoyAI-Image-Edit/metadata.csv" \
    --max_pixels 1048576 \
    --dataset_repeat 1 \
    --model_id_with_origin_paths "jd-opensource/JoyAI-Image-Edit:JoyAI-Image-Und/model*.safetensors,jd-opensource/JoyAI-Image-Edit:vae/Wan2.1_VAE.pth" \
    --learning_rate 1e-4 \
    --num_epochs 5 \
    --remove_prefix_in_ckpt "pipe.dit." \
    --output_path "./models/train/JoyAI-Image-Edit-split-cache" \
    --lora_base_model "dit" \
    --lora_target_modules "img_attn_qkv,txt_attn_qkv,img_attn_proj,txt_attn_proj" \
    --lora_rank 32 \
    --use_gradient_checkpointing \
    --find_unused_parameters \
    --data_file_keys "image,edit_image" \
    --extra_inputs "edit_image" \
    --task "sft:data_process"

accelerate launch examples/joyai_image/model_training/train.py \
    --dataset_base_path "./models/train/JoyAI-Image-Edit-split-cache" \
    --max_pixels 1048576 \
    --dataset_repeat 50 \
    --model_id_with_origin_paths "jd-opensource/JoyAI-Image-Edit:transformer/transformer.pth" \
    --learning_rate 1e-4 \
    --num_epochs 5 \
    --remove_prefix_in_ckpt "pipe.dit." \
    --output_path "./models/train/JoyAI-Image-Edit-lora" \
    --lora_base_model "dit" \
    --lora_target_modules "img_attn_qkv,txt_attn_qkv,img_attn_proj,txt_attn_proj" \
    --lora_rank 32 \
    --use_gradient_checkpointing \
    --find_unused_parameters \
    --data_file_keys "image,edit_image" \
    --extra_inputs "edit_image" \
    --task "sft:train"
"""

# both commands' models in one run, trained unsplit (the run the dry run compares stage 2 with)
JOYAI_IMAGE_UNSPLIT = JOYAI_IMAGE_COMMANDS.strip().split("\n\n")[0].replace(
    '"jd-opensource/JoyAI-Image-Edit:JoyAI-Image-Und',
    '"jd-opensource/JoyAI-Image-Edit:transformer/transformer.pth,jd-opensource/JoyAI-Image-Edit:JoyAI-Image-Und'
).replace('"sft:data_process"', '"sft"')


def test_diffsynths_joyai_image_commands_run_as_they_are(tmp_path, monkeypatch, capsys):
    """DiffSynth's examples/joyai_image/model_training/lora/JoyAI-Image-Edit.sh, both commands, with `unitgraph train`
    for `accelerate launch .../train.py`; only sizes are lowered (--num_epochs, --dataset_repeat). The model ids alone
    choose DiffSynth's pipeline. Its DiT and VAE are released as `.pth` pickles: each command is refused in one line
    naming the pickle and the command that writes its safetensors twin (`unitgraph twin`), which then runs; stage 2
    reads the DiT's twin with the pickle removed, and the encoder's and the VAE's folders gone. The LoRA is in
    DiffSynth's layout, rank 32, on the picture and the text streams."""
    from clitools import cli, one_error_line

    command_1, command_2 = JOYAI_IMAGE_COMMANDS.strip().split("\n\n")
    argv_1, argv_2 = ported(command_1, "joyai_image", tmp_path, monkeypatch, edit=True), shlex_argv(command_2)
    argv_2[argv_2.index("--num_epochs") + 1] = "1"
    argv_2[argv_2.index("--dataset_repeat") + 1] = "1"
    root = tmp_path / "models" / "jd-opensource" / "JoyAI-Image-Edit"
    for twin in (root / "vae" / "Wan2.1_VAE.safetensors", root / "transformer" / "transformer.safetensors"):
        twin.unlink()  # as released: the pickles alone

    def converted(argv: list[str], pickle: Path) -> None:  # refused in one line; its command writes the twin
        code, out, err = cli(capsys, "train", *argv)
        shown = pickle.relative_to(tmp_path)  # (DiffSynth's ./models, relative to where the command runs)
        line = one_error_line(code, err, f"{shown}: a pickle (torch.save), which unitgraph does not unpickle")
        assert line.endswith(f"beside it once: unitgraph twin {shown}"), line
        code, out, err = cli(capsys, *line.rsplit(": ", 1)[1].split()[1:])
        assert code == 0 and pickle.with_suffix(".safetensors").is_file(), err

    converted(argv_1, root / "vae" / "Wan2.1_VAE.pth")
    code, out, err = cli(capsys, "train", *argv_1)
    assert code == 0, err
    assert "pipeline: diffsynth:joyai_image (DiffSynth's JoyAIImagePipeline; the model id names JoyAI-Image)" in out, out
    assert "stage 1 runs" in out and "(text_encoder, vae)" in out, out
    converted(argv_2, root / "transformer" / "transformer.pth")
    (root / "transformer" / "transformer.pth").unlink()  # converted, the pickle may go
    for folder in ("JoyAI-Image-Und", "vae"):
        shutil.move(str(root / folder), str(tmp_path / f"gone-{folder}"))
    try:
        code, out, err = cli(capsys, "train", *argv_2)
    finally:
        for folder in ("JoyAI-Image-Und", "vae"):
            shutil.move(str(tmp_path / f"gone-{folder}"), str(root / folder))
    assert code == 0, err
    assert "stage 2 (train): 2 steps" in out, out
    lora = load_file(str(tmp_path / "models" / "train" / "JoyAI-Image-Edit-lora" / "epoch-0.safetensors"))
    assert lora and not any(k.startswith("pipe.") for k in lora)
    assert any(".img_attn_qkv.lora_A." in k for k in lora) and any(".txt_attn_proj.lora_B." in k for k in lora)
    assert {v.shape[0] for k, v in lora.items() if ".lora_A." in k} == {32}


# examples/hidream_o1_image/model_training/lora/HiDream-O1-Image-Dev.sh, its command as it is
HIDREAM_O1_IMAGE_COMMAND = r"""
accelerate launch examples/hidream_o1_image/model_training/train.py \
  --dataset_base_path data/diffsynth_example_dataset/hidream_o1_image/HiDream-O1-Image-Dev \
  --dataset_metadata_path data/diffsynth_example_dataset/hidream_o1_image/HiDream-O1-Image-Dev/metadata.csv \
  --max_pixels 4194304 \
  --dataset_repeat 50 \
  --model_id_with_origin_paths "HiDream-ai/HiDream-O1-Image-Dev:model-*.safetensors" \
  --processor_config "HiDream-ai/HiDream-O1-Image-Dev:./" \
  --learning_rate 1e-4 \
  --num_epochs 5 \
  --lora_rank 32 \
  --remove_prefix_in_ckpt "pipe.dit." \
  --output_path "./models/train/HiDream-O1-Image-Dev_lora" \
  --lora_base_model "dit" \
  --lora_target_modules "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj,attn.qkv,attn.proj,mlp.linear_fc1,mlp.linear_fc2" \
  --use_gradient_checkpointing \
  --noise_scale 7.5
"""


def test_diffsynths_hidream_o1_image_lora_command_runs_as_it_is(tmp_path, monkeypatch, capsys):
    """DiffSynth's examples/hidream_o1_image/model_training/lora/HiDream-O1-Image-Dev.sh with `unitgraph train` for
    `accelerate launch .../train.py`; only sizes are lowered (--num_epochs, --dataset_repeat; 64 px samples: 2x2
    patches). The model ids alone choose DiffSynth's pipeline; its processor is read where --processor_config names
    it, the release's root beside the DiT's four shards (the released 8.80 B DiT, known to DiffSynth's table by its
    key hash). Stage 1 loads no model (it tokenizes); its entries hold --noise_scale, and a stage 2 that says another
    is one line; a picture of one patch is one line."""
    from clitools import cli, one_error_line

    argv = ported(HIDREAM_O1_IMAGE_COMMAND, "hidream_o1_image", tmp_path, monkeypatch, size=64)
    root = tmp_path / "models" / "HiDream-ai" / "HiDream-O1-Image-Dev"
    assert len(list(root.glob("model-*-of-00004.safetensors"))) == 4 and (root / "tokenizer_config.json").is_file()
    code, out, err = cli(capsys, "train", *argv)
    assert code == 0, err
    assert ("pipeline: diffsynth:hidream_o1_image (DiffSynth's HiDreamO1ImagePipeline; the model id names "
            "HiDream-O1-Image)") in out, out
    plan = next(line for line in out.splitlines() if line.startswith("plan:"))
    assert "PromptTokenizer" in plan.split("stage 2")[0] and "(no model)" in plan.split("stage 2")[0], plan
    assert plan.endswith("(dit)"), plan
    assert "training: 2 steps" in out, out
    lora = load_file(str(tmp_path / "models" / "train" / "HiDream-O1-Image-Dev_lora" / "epoch-0.safetensors"))
    assert lora and not any(k.startswith("pipe.") for k in lora)
    assert any(".self_attn.q_proj.lora_A." in k for k in lora) and any(".mlp.down_proj.lora_B." in k for k in lora)
    assert any(".visual.blocks.0.attn.qkv.lora_A." in k for k in lora)  # its vision tower's, as its example names
    assert {v.shape[0] for k, v in lora.items() if ".lora_A." in k} == {32}

    def at(flag: str, value: str) -> list[str]:
        changed = list(argv)
        changed[changed.index(flag) + 1] = value
        return changed

    cache = tmp_path / "cache"
    code, out, err = cli(capsys, "train", *at("--output_path", str(cache)), "--task", "sft:data_process")
    assert code == 0, err
    entry = next((cache / "entries").glob("*.safetensors"))
    from unitgraph.backends.diffusion.cache.entries import read_entry

    values, _meta = read_entry(entry)
    assert values["inputs_shared"]["noise_scale"] == 7.5  # the command's, handed to the loss in stage 2
    stage_2 = [*at("--dataset_base_path", str(cache)), "--task", "sft:train"]
    stage_2[stage_2.index("--noise_scale") + 1] = "8"
    code, out, err = cli(capsys, "train", *stage_2)
    one_error_line(code, err, "--noise_scale 8: this cache's entries hold noise_scale 7.5 (stage 1's)")
    # stage 2 as the cache says, drawing a validation sample: the processor is read for it, beside the DiT
    stage_2 = [*at("--dataset_base_path", str(cache)), "--task", "sft:train", "--output_path", str(tmp_path / "split"),
               "--validation_prompt", "a red circle", "--validation_inference_steps", "2", "--validation_guidance",
               "1", "--height", "64", "--width", "64"]
    stage_2.remove("--noise_scale")
    stage_2.remove("7.5")
    code, out, err = cli(capsys, "train", *stage_2)
    assert code == 0, err
    from PIL import Image

    with Image.open(tmp_path / "split" / "samples" / "epoch-0" / "0.png") as drawn:
        assert drawn.size == (64, 64)
    code, out, err = cli(capsys, "train", *at("--output_path", str(tmp_path / "small")), "--height", "32",
                         "--width", "32", "--task", "sft:data_process")
    one_error_line(code, err, "row 1: the picture is 32x32 as trained, diffsynth:hidream_o1_image needs at least 2 "
                              "patches of 32 px")
    assert not (tmp_path / "small" / "entries").exists() or not any((tmp_path / "small" / "entries").iterdir())


SD_FULL_COMMANDS = {
    "stable_diffusion": r"""
accelerate launch examples/stable_diffusion/model_training/train.py \
  --dataset_base_path data/diffsynth_example_dataset/stable_diffusion/stable-diffusion-v1-5 \
  --dataset_metadata_path data/diffsynth_example_dataset/stable_diffusion/stable-diffusion-v1-5/metadata.csv \
  --height 512 \
  --width 512 \
  --dataset_repeat 50 \
  --model_id_with_origin_paths "AI-ModelScope/stable-diffusion-v1-5:text_encoder/model.safetensors,AI-ModelScope/stable-diffusion-v1-5:unet/diffusion_pytorch_model.safetensors,AI-ModelScope/stable-diffusion-v1-5:vae/diffusion_pytorch_model.safetensors" \
  --learning_rate 1e-5 \
  --num_epochs 2 \
  --trainable_models "unet" \
  --remove_prefix_in_ckpt "pipe.unet." \
  --output_path "./models/train/stable-diffusion-v1-5_full" \
  --use_gradient_checkpointing
""",
    "stable_diffusion_xl": r"""
accelerate launch examples/stable_diffusion_xl/model_training/train.py \
  --dataset_base_path data/diffsynth_example_dataset/stable_diffusion_xl/stable-diffusion-xl-base-1.0 \
  --dataset_metadata_path data/diffsynth_example_dataset/stable_diffusion_xl/stable-diffusion-xl-base-1.0/metadata.csv \
  --height 1024 \
  --width 1024 \
  --dataset_repeat 10 \
  --model_id_with_origin_paths "stabilityai/stable-diffusion-xl-base-1.0:text_encoder/model.safetensors,stabilityai/stable-diffusion-xl-base-1.0:text_encoder_2/model.safetensors,stabilityai/stable-diffusion-xl-base-1.0:unet/diffusion_pytorch_model.safetensors,stabilityai/stable-diffusion-xl-base-1.0:vae/diffusion_pytorch_model.safetensors" \
  --learning_rate 1e-5 \
  --num_epochs 2 \
  --trainable_models "unet" \
  --remove_prefix_in_ckpt "pipe.unet." \
  --output_path "./models/train/stable-diffusion-xl-base-1.0_full" \
  --use_gradient_checkpointing
""",
}


@pytest.mark.parametrize("module", sorted(SD_FULL_COMMANDS))
def test_diffsynths_sd_full_commands_run_as_they_are(module, tmp_path, monkeypatch, capsys):
    """DiffSynth's full fine-tuning of SD 1.5 and SDXL with `unitgraph train` for `accelerate launch .../train.py`,
    `--pipeline diffsynth:MODULE` added (the model ids alone choose unitgraph's own family), sizes lowered (--height and
    --width 32, --num_epochs 1, --dataset_repeat 1): the whole UNet trains in fp32 and is written once, without the
    prefix the command removes, keyed as the UNet's own parameters."""
    from clitools import cli

    monkeypatch.chdir(tmp_path)
    for name in ("DIFFSYNTH_MODEL_BASE_PATH", "DIFFSYNTH_SKIP_DOWNLOAD"):
        monkeypatch.delenv(name, raising=False)
    write_tiny_models(tmp_path / "models", module)
    argv = shlex_argv(SD_FULL_COMMANDS[module])
    write_synthetic_dataset(tmp_path / argv[argv.index("--dataset_base_path") + 1], count=2, size=32)
    for flag, value in (("--height", "32"), ("--width", "32"), ("--num_epochs", "1"), ("--dataset_repeat", "1")):
        argv[argv.index(flag) + 1] = value
    code, out, err = cli(capsys, "train", *argv, "--pipeline", f"diffsynth:{module}")
    assert code == 0, err
    assert "training: 2 steps" in out, out
    output = tmp_path / argv[argv.index("--output_path") + 1]
    weights = load_file(str(output / "epoch-0.safetensors"))
    unet = load_file(str(next((tmp_path / "models").glob("*/*/unet/diffusion_pytorch_model.safetensors"))))
    assert weights and not any(k.startswith("pipe.") for k in weights)
    assert {v.dtype for v in weights.values()} == {torch.float32}
    assert len(weights) == len(unet) and any(not torch.equal(weights[k], unet[k]) for k in weights if k in unet)


def released_plan(command: str, tmp_path: Path, monkeypatch, capsys) -> dict:
    """The --dry_run --json plan of a DiffSynth example's command at the released sizes, run in an empty folder with
    downloads off: nothing is looked for, downloaded or written (no ./models appears)."""
    import json

    from clitools import cli

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("DIFFSYNTH_SKIP_DOWNLOAD", "True")
    monkeypatch.delenv("DIFFSYNTH_MODEL_BASE_PATH", raising=False)
    code, out, err = cli(capsys, "train", *shlex_argv(command), "--dry_run", "--json")
    assert code == 0, err
    assert not (tmp_path / "models").exists()
    return json.loads(out[out.index("{"):])


# the released sizes of DiffSynth's examples whose classes fix a large size, as its model-config table builds them:
# {module: (its command, {model: (class, fewest parameters, most)}, the most stage 2 may hold of the unsplit run)}
RELEASED = {
    # the turbo file holds the DiT, the condition encoder and the audio tokenizer
    "ace_step": (ACE_STEP_COMMAND, {"dit": ("AceStepDiTModel", 1.5e9, 1.65e9),
                                    "conditioner": ("AceStepConditionEncoder", 0.6e9, 0.62e9),
                                    "text_encoder": ("AceStepTextEncoder", 0.59e9, 0.6e9),
                                    "vae": ("AceStepVAE", 0.16e9, 0.18e9)}, 0.65),
    # the VAE is sized as FLUX.2's (DiffSynth's table knows it under FLUX.2-dev's example)
    "ernie_image": (ERNIE_IMAGE_COMMAND, {"dit": ("ErnieImageDiT", 7.9e9, 8.1e9),
                                          "text_encoder": ("ErnieImageTextEncoder", 3.4e9, 3.5e9),
                                          "vae": ("Flux2VAE", 0.05e9, 0.1e9)}, 0.75),
    "krea2": (KREA2_COMMAND, {"dit": ("SingleStreamDiT", 12.7e9, 12.9e9),
                              "text_encoder": ("Krea2TextEncoder", 4.4e9, 4.5e9),
                              "vae": ("QwenImageVAE", 0.1e9, 0.15e9)}, 0.8),
    # the VAE is sized as Qwen-Image's (the same weights under Qwen-Image's example)
    "lingbot_video": (LINGBOT_VIDEO_COMMAND, {"dit": ("LingBotVideoDiT", 1.3e9, 1.4e9),
                                              "text_encoder": ("Krea2TextEncoder", 4.4e9, 4.5e9),
                                              "vae": ("QwenImageVAE", 0.1e9, 0.15e9)}, 0.3),
    # Qwen2.5-VL 7B's encoder (its vision tower and lm_head included), the DiT of 60 blocks
    "qwen_image": (QWEN_IMAGE_DIFFSYNTH, {"dit": ("QwenImageDiT", 20.3e9, 20.5e9),
                                          "text_encoder": ("QwenImageTextEncoder", 8.28e9, 8.3e9),
                                          "vae": ("QwenImageVAE", 0.1e9, 0.15e9)}, 0.8),
    # Qwen3-VL 8B's encoder, the 16-channel VAE (encoder and decoder from one file)
    "boogu_image": (BOOGU_IMAGE_COMMAND, {"dit": ("BooguImageDiT", 10.2e9, 10.4e9),
                                          "text_encoder": ("QwenImage21TextEncoder", 8.7e9, 8.8e9),
                                          "vae_encoder": ("FluxVAEEncoder", 0.03e9, 0.04e9)}, 0.6),
    # Boogu-Image's encoder, Wan 2.1's VAE (both known to DiffSynth's table under other patterns), the DiT of 40 blocks
    "joyai_image": (JOYAI_IMAGE_UNSPLIT, {"dit": ("JoyAIImageDiT", 16.2e9, 16.3e9),
                                          "text_encoder": ("QwenImage21TextEncoder", 8.7e9, 8.8e9),
                                          "vae": ("WanVideoVAE", 0.1e9, 0.15e9)}, 0.7),
    # its one model, the DiT (Qwen3-VL 8B with its vision tower, its lm_head, and its patch and timestep layers):
    # stage 1 loads none (it tokenizes), so stage 2 holds what the unsplit run holds
    "hidream_o1_image": (HIDREAM_O1_IMAGE_COMMAND, {"dit": ("HiDreamO1ImageModel", 8.8e9, 8.81e9)}, 1.001),
    # the Qwen3 0.6 B text encoder, the Wan 2.1 VAE
    "anima_image": (ANIMA_COMMAND, {"dit": ("AnimaDiT", 2.0e9, 2.2e9),
                                    "text_encoder": ("ZImageTextEncoder", 0.5e9, 0.7e9),
                                    "vae": ("WanVideoVAE", 0.1e9, 0.15e9)}, 0.8),
    # the high-noise expert's command; the experts sized as Wan 2.2 I2V A14B's, the audio DiT and the bridge as
    # MOVA-720p's, the converted VAE and T5 as the .pth files they convert
    "mova_audio_video": (MOVA_COMMANDS[0], {"video_dit": ("WanModel", 14.2e9, 14.4e9),
                                            "audio_dit": ("MovaAudioDit", 1.4e9, 1.45e9),
                                            "dual_tower_bridge": ("DualTowerConditionalBridge", 2.6e9, 2.7e9),
                                            "audio_vae": ("DacVAE", 0.35e9, 0.4e9),
                                            "video_vae": ("WanVideoVAE", 0.1e9, 0.15e9),
                                            "text_encoder": ("WanTextEncoder", 5.6e9, 5.7e9)}, 0.8),
}
# what stage 2 holds where not the DiT alone: MOVA's two towers and their bridge (the in-iteration models)
RELEASED_STAGE_2 = {"mova_audio_video": ["audio_dit", "dual_tower_bridge", "video_dit"],
                    "ace_step": ["dit", "vae"]}  # its VAE encodes the song to the drawn noise's length
# the files a model is sized from, where DiffSynth's table says otherwise (its Qwen-Image DiT and text encoder entries
# name each other's file patterns: the glue's `sized_as`)
RELEASED_FILES = {"qwen_image": {"dit": "Qwen/Qwen-Image:transformer/", "text_encoder": "Qwen/Qwen-Image:text_encoder/"}}


@pytest.mark.parametrize("module", sorted(RELEASED))
def test_the_dry_run_of_a_released_pipeline_needs_no_file(module, tmp_path, monkeypatch, capsys):
    """DiffSynth's LoRA command of a pipeline whose classes fix a large size, --dry_run, nothing downloaded: each file
    sized as DiffSynth's table knows it; stage 2 holds the DiT alone (MOVA: its towers and bridge), at most the given
    share of the unsplit run."""
    command, sizes, share = RELEASED[module]
    plan = released_plan(command, tmp_path, monkeypatch, capsys)
    for name, (cls, fewest, most) in sizes.items():
        assert plan["models"][name]["class"] == cls, name
        assert fewest < plan["models"][name]["params"] < most, name
    for name, prefix in RELEASED_FILES.get(module, {}).items():
        assert plan["models"][name]["file"].startswith(prefix), name
    assert plan["stages"]["train"]["models"] == RELEASED_STAGE_2.get(module, ["dit"])
    assert plan["stages"]["train"]["total"] < share * plan["stages"]["unsplit"]["total"]


def shlex_argv(command: str) -> list[str]:
    """The flags of a DiffSynth example's `accelerate launch examples/<family>/model_training/train.py ...`."""
    import shlex

    argv = shlex.split(command.replace("\\\n", " "))
    return argv[next(i for i, word in enumerate(argv) if word.endswith("/model_training/train.py")) + 1:]


def test_what_a_file_is_does_not_depend_on_entries_another_pipeline_registered(world):
    """An entry of the same key hash naming another pipeline's model (SD's and SDXL's test-size VAEs share their
    shapes; a process that set up SDXL first registered its own) changes neither what the file loads as here nor the
    cache key: before, SD 1.5's stage 1 made other entry keys after an SDXL run in the same process."""
    from diffsynth.configs import MODEL_CONFIGS

    root, flags = world
    before = [m.identity() for m in ds_run.setup(_args(root, flags)).models]
    hashes = {e["model_hash"] for m in ds_run.setup(_args(root, flags)).models for e in m.entries}
    others = [dict(c, model_name="another_pipelines_model") for c in MODEL_CONFIGS if c["model_hash"] in hashes]
    assert others
    MODEL_CONFIGS.extend(others)
    try:
        assert [m.identity() for m in ds_run.setup(_args(root, flags)).models] == before
    finally:
        del MODEL_CONFIGS[-len(others):]


@pytest.mark.parametrize("world", ["ideogram4"], indirect=True)
def test_the_same_weights_in_another_folder_are_read_with_that_folders_configuration(world, tmp_path):
    """A test-size file is recognised by the config.json beside it, and the entry registered for it names that
    configuration (Ideogram 4's text encoder class reads its configuration's folder itself). The same weights in
    another folder, the first gone, load with the second folder's: the first's entry, which DiffSynth's loader
    would also load (it loads a file as every entry of its hash), is replaced. Before, a later test loading a copy
    of a removed folder's models failed reading the removed folder."""
    from diffsynth.configs import MODEL_CONFIGS

    from unitgraph.backends.diffusion.diffsynth_source.models import REGISTERED_FROM, recognise

    root, _flags = world
    source = root / "models" / "DiffSynth-Studio" / "ideogram-4-bf16-repackage" / "text_encoder"
    first, second = tmp_path / "a" / "text_encoder", tmp_path / "b" / "text_encoder"
    shutil.copytree(source, first)
    shutil.copytree(source, second)
    attributes = {"ideogram4_text_encoder": "text_encoder"}
    (entry,) = recognise(str(first / "model.safetensors"), attributes)
    assert entry["extra_kwargs"]["config_path"] == str(first) and entry[REGISTERED_FROM] == str(first / "config.json")
    shutil.rmtree(first)
    (again,) = recognise(str(second / "model.safetensors"), attributes)
    assert again["extra_kwargs"]["config_path"] == str(second)
    same_hash = [c for c in MODEL_CONFIGS if c["model_hash"] == entry["model_hash"]]
    assert [c.get(REGISTERED_FROM) for c in same_hash] == [str(second / "config.json")]
    assert recognise(str(second / "model.safetensors"), attributes) == (again,)  # known now: nothing registered


def test_the_plan_narrows_an_image_unit_to_what_the_loss_reads():
    """DiffSynth's FlowMatchSFTLoss overwrites `latents` before reading it, so the image unit, which returns the noise
    as `latents`, is planned for `input_latents` alone and goes to stage 1 with its VAE (Ideogram 4); SD 1.5's image
    unit draws from the VAE posterior itself and stays in training."""
    from diffsynth.diffusion.loss import FlowMatchSFTLoss

    from unitgraph.backends.diffusion.diffsynth_source.planning import loss_overwrites

    assert loss_overwrites(FlowMatchSFTLoss) == {"latents"}
    ideogram = ds_run.setup(make_args(pipeline="diffsynth:ideogram4", lora_base_model="dit", dry_run=True))
    assert "InputImageEmbedder" in ideogram.plan.data_process_units and "vae" in ideogram.plan.data_process_models
    assert ideogram.plan.train_units == ["NoiseInitializer"]
    assert "InputImageEmbedder: planned for input_latents only" in ideogram.notes["InputImageEmbedder"]
    sd = ds_run.setup(make_args(pipeline="diffsynth:stable_diffusion", lora_base_model="unet", dry_run=True))
    assert "InputImageEmbedder" in sd.plan.train_units and "vae" in sd.plan.train_models


def test_resume_continues_exactly_from_a_state_mid_epoch(world, tmp_path):
    """A run stopped after its first epoch, continued from the state it wrote mid-epoch (--save_steps) with more
    epochs, takes the uninterrupted run's very steps: the same losses from there on and the same LoRA, bit for bit."""
    root, flags = world
    if flags["module"] != "stable_diffusion":
        pytest.skip("one pipeline shows the loop's resume")
    common = dict(dataset_repeat=2, save_steps=4, save_total_limit=0)
    straight = run(_args(root, flags, num_epochs=2, output_path=str(tmp_path / "straight"), **common))
    out = tmp_path / "stopped"
    first = run(_args(root, flags, num_epochs=1, output_path=str(out), **common))
    assert first.losses == straight.losses[:6]
    states = sorted(p.name for p in (out / "state").iterdir())
    assert states == ["step-4", "step-6"]
    continued = run(_args(root, flags, num_epochs=2, output_path=str(out), resume=str(out / "state" / "step-4"),
                          **common))
    assert continued.losses == straight.losses[4:]
    a, b = load_file(str(straight.last_checkpoint)), load_file(str(continued.last_checkpoint))
    assert continued.last_checkpoint.name == "epoch-1.safetensors" and all(torch.equal(a[k], b[k]) for k in a)
    rows = (out / "loss.csv").read_text().splitlines()
    assert len(rows) == 1 + 12 and rows[1:] == (tmp_path / "straight" / "loss.csv").read_text().splitlines()[1:]
    # the newest state, by --resume alone ("latest"), after the run finished: nothing left to do, the same file
    again = run(_args(root, flags, num_epochs=2, output_path=str(out), resume="latest", **common))
    assert again.steps == 0
    with pytest.raises(BackendError, match="the state was made with seed 3, this run has 4"):
        run(_args(root, flags, num_epochs=3, output_path=str(out), resume="latest", seed=4, **common))


def test_a_folder_of_someone_elses_files_is_refused_and_left_alone(world, tmp_path):
    root, flags = world
    if flags["module"] != "stable_diffusion":
        pytest.skip("one pipeline shows the output folder's rules")
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "epoch-0.safetensors").write_bytes(b"my own file")
    from unitgraph.errors import UnitgraphError

    with pytest.raises(UnitgraphError, match="not a unitgraph run folder"):
        run(_args(root, flags, output_path=str(folder)))
    with pytest.raises(BackendError, match="not a stage-1 cache of unitgraph's"):
        run(_args(root, flags, task="sft:data_process", output_path=str(folder)))
    assert (folder / "epoch-0.safetensors").read_bytes() == b"my own file"
    assert sorted(p.name for p in folder.iterdir()) == ["epoch-0.safetensors"]


def test_validation_samples_are_diffsynths_own_drawing_and_change_no_step(world, tmp_path):
    """--validation_prompt at each checkpoint through the pipeline's own __call__: the unsplit run's sample equals
    DiffSynth's drawing with the checkpoint loaded by its load_lora (bit for bit at fp32); the losses equal a run
    without samples; stage 2, which trains without the text encoder, loads it only to render and draws the same;
    samples.html shows them; with --validation_steps they are drawn every N optimizer steps instead."""
    import numpy as np
    from diffsynth.core import ModelConfig
    from PIL import Image

    root, flags = world
    if flags["module"] != "stable_diffusion":
        pytest.skip("the fp32 pipeline shows the drawing bit for bit")
    extra = dict(num_epochs=1, learning_rate=1e-2, validation_prompt=["a red circle"], validation_inference_steps=3)
    plain = run(_args(root, flags, num_epochs=1, learning_rate=1e-2, output_path=str(tmp_path / "plain")))
    drawn = run(_args(root, flags, output_path=str(tmp_path / "drawn"), **extra))
    assert drawn.losses == plain.losses
    sample = tmp_path / "drawn" / "samples" / "epoch-0" / "0.png"
    assert drawn.sample_images == [sample]
    setup = ds_run.setup(_args(root, flags))
    configs = [ModelConfig(path=m.path) for m in setup.models]
    pipe = setup.pipe_class.from_pretrained(torch_dtype=torch.float32, device="cpu", model_configs=configs,
                                            tokenizer_config=ModelConfig(path=flags["tokenizer_path"]))
    pipe.load_lora(pipe.unet, str(drawn.last_checkpoint))
    theirs = pipe(prompt="a red circle", height=32, width=32, seed=3, rand_device="cpu", num_inference_steps=3)
    assert np.array_equal(np.asarray(theirs), np.asarray(Image.open(sample)))
    # stage 2 from a cache: the text encoder's file named for the render only
    cache = tmp_path / "cache"
    run(_args(root, flags, task="sft:data_process", output_path=str(cache)))
    split = run(_args(root, flags, task="sft:train", dataset_base_path=str(cache), dataset_metadata_path=None,
                      output_path=str(tmp_path / "split"), **extra))
    assert split.losses == drawn.losses
    assert np.array_equal(np.asarray(Image.open(split.sample_images[0])), np.asarray(Image.open(sample)))
    page = (tmp_path / "split" / "samples.html").read_text(encoding="utf-8")
    assert 'src="samples/epoch-0/0.png"' in page and "a red circle" in page
    # every --validation_steps optimizer steps instead of at the checkpoints; the page shows each, oldest first
    steps = run(_args(root, flags, output_path=str(tmp_path / "steps"), **{**extra, "num_epochs": 2},
                      validation_steps=2))
    assert [p.parent.name for p in steps.sample_images] == ["step-2", "step-4", "step-6"]
    page = (tmp_path / "steps" / "samples.html").read_text(encoding="utf-8")
    assert page.index("samples/step-2/0.png") < page.index("samples/step-4/0.png") < page.index("samples/step-6/0.png")
    ids = ",".join(p for p in flags["model_id_with_origin_paths"].split(",") if "text_encoder" not in p)
    with pytest.raises(BackendError, match="names no file of text_encoder"):
        run(_args(root, flags, task="sft:train", dataset_base_path=str(cache), dataset_metadata_path=None,
                  model_id_with_origin_paths=ids, output_path=str(tmp_path / "lacking"), **extra))


def test_the_dry_run_of_the_released_z_image_needs_no_file(tmp_path, monkeypatch, capsys):
    """DiffSynth's Z-Image LoRA command, --dry_run, nothing downloaded: the 6 B DiT and Z-Image-Turbo's 4 B text
    encoder from DiffSynth's table; its VAE file holds an encoder (stage 1) and a decoder (drawing only)."""
    import json

    from clitools import cli

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("DIFFSYNTH_SKIP_DOWNLOAD", "True")
    monkeypatch.delenv("DIFFSYNTH_MODEL_BASE_PATH", raising=False)  # a module fixture's tiny ./models may be set
    code, out, err = cli(capsys, "train", "--pipeline", "diffsynth:z_image", "--dry_run", "--json",
                         "--dataset_base_path", "data", "--lora_base_model", "dit", "--lora_rank", "32",
                         "--lora_target_modules", "to_q,to_k,to_v,to_out.0,w1,w2,w3", "--model_id_with_origin_paths",
                         "Tongyi-MAI/Z-Image:transformer/*.safetensors,Tongyi-MAI/Z-Image-Turbo:text_encoder/*.safetensors,"
                         "Tongyi-MAI/Z-Image-Turbo:vae/diffusion_pytorch_model.safetensors")
    assert code == 0, err
    plan = json.loads(out[out.index("{"):])
    models, stages = plan["models"], plan["stages"]
    assert 6.0e9 < models["dit"]["params"] < 6.3e9 and 3.9e9 < models["text_encoder"]["params"] < 4.1e9
    assert stages["data_process"]["models"] == ["text_encoder", "vae_encoder"] and stages["train"]["models"] == ["dit"]
    assert "vae_decoder" in models and not (tmp_path / "models").exists()


@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="DeepSpeed is not installed")
def test_the_dry_run_under_diffsynths_zero3_config_is_per_process(tmp_path, monkeypatch, capsys):
    """DiffSynth's full Z-Image command with its ZeRO-3 config over 8 processes, --dry_run: stage 2 holds an eighth
    of the 6 B DiT's bf16 weights, of its gradients, of AdamW's moments and of the fp32 masters; stage 1 is as
    without an engine; the same with ZeRO-2 keeps the weights whole; FSDP2 shards the weights as ZeRO-3 does, without
    masters."""
    import json

    from clitools import cli

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("DIFFSYNTH_SKIP_DOWNLOAD", "True")
    monkeypatch.delenv("DIFFSYNTH_MODEL_BASE_PATH", raising=False)
    ids = ("Tongyi-MAI/Z-Image:transformer/*.safetensors,Tongyi-MAI/Z-Image-Turbo:text_encoder/*.safetensors,"
           "Tongyi-MAI/Z-Image-Turbo:vae/diffusion_pytorch_model.safetensors")

    def dry_run(name: str, text: str) -> dict:
        config = tmp_path / name
        config.write_text(text)
        code, out, err = cli(capsys, "train", "--pipeline", "diffsynth:z_image", "--dry_run", "--json",
                             "--dataset_base_path", "data", "--trainable_models", "dit", "--model_id_with_origin_paths",
                             ids, "--config_file", str(config))
        assert code == 0, err
        return json.loads(out[out.index("{"):])

    plans = {stage: dry_run(f"zero{stage}.yaml", f"distributed_type: DEEPSPEED\nmixed_precision: bf16\nnum_processes: "
                            f"8\ndeepspeed_config:\n  zero_stage: {stage}\n  offload_optimizer_device: none\n"
                            "  offload_param_device: none\n")
             for stage in (2, 3)}
    dit = plans[3]["models"]["dit"]
    n = dit["params"]
    two, three = plans[2]["stages"], plans[3]["stages"]
    assert three["train"]["weights"] == -(-dit["bytes"] // 8) and two["train"]["weights"] == dit["bytes"]
    for plan in (two, three):
        assert plan["train"]["optimizer"] == -(-8 * n // 8) and plan["train"]["master"] == -(-4 * n // 8)
        assert plan["train"]["gradients"] == -(-2 * n // 8)
    assert three["data_process"] == two["data_process"] and three["data_process"]["master"] == 0
    assert three["unsplit"]["weights"] == three["train"]["weights"] + sum(
        plans[3]["models"][m]["bytes"] for m in three["data_process"]["models"])
    code, out, err = cli(capsys, "train", "--pipeline", "diffsynth:z_image", "--dry_run", "--dataset_base_path", "data",
                         "--trainable_models", "dit", "--model_id_with_origin_paths", ids, "--config_file",
                         str(tmp_path / "zero3.yaml"))
    assert code == 0 and "per process under DeepSpeed ZeRO-3 over 8 processes" in out, out
    # FSDP2 over 8: the weights, gradients and moments an eighth each, no fp32 masters (it steps the bf16 weights);
    # offloaded, the shards, their gradients and the moments are in CPU memory
    for offload in ("false", "true"):
        plans[offload] = dry_run(f"fsdp2-{offload}.yaml", "distributed_type: FSDP\nnum_processes: 8\nfsdp_config:\n"
                                 f"  fsdp_version: 2\n  fsdp_offload_params: {offload}\n")["stages"]
    fsdp, off = plans["false"]["train"], plans["true"]["train"]
    assert fsdp["weights"] == three["train"]["weights"] and fsdp["master"] == 0
    assert fsdp["gradients"] == -(-2 * n // 8) and fsdp["optimizer"] == -(-8 * n // 8)
    assert off["weights"] == 0 and off["gradients"] == off["optimizer"] == 0
    assert off["host"] == fsdp["weights"] + fsdp["gradients"] + fsdp["optimizer"]
    assert plans["true"]["data_process"] == two["data_process"]


def test_tiny_models_command_writes_a_diffsynth_pipelines_models(tmp_path, monkeypatch, capsys):
    """`unitgraph tiny-models DIR --pipeline diffsynth:ideogram4` writes DiffSynth's ./models layout and says the
    command that trains on it; that command trains."""
    from clitools import cli

    monkeypatch.chdir(tmp_path)
    code, out, err = cli(capsys, "tiny-models", "models", "--pipeline", "diffsynth:ideogram4")
    assert code == 0, err
    line = out.strip().splitlines()[-1]
    ids = line.split("--model_id_with_origin_paths '")[1].split("'")[0]
    monkeypatch.setenv("DIFFSYNTH_MODEL_BASE_PATH", "models")
    write_synthetic_dataset(tmp_path / "data", count=2, size=32)
    code, out, err = cli(capsys, "train", "--pipeline", "diffsynth:ideogram4", "--model_id_with_origin_paths", ids,
                         "--lora_base_model", "dit", "--lora_target_modules", "attention.qkv,attention.o",
                         "--dataset_base_path", "data", "--dataset_metadata_path", "data/metadata.csv",
                         "--height", "32", "--width", "32", "--output_path", "out")
    assert code == 0, err
    assert (tmp_path / "out" / "epoch-0.safetensors").is_file()


def test_sdxl_checkpoints_in_the_open_source_layout_load_with_diffsynth(world, tmp_path):
    """--align_to_opensource_format, as DiffSynth's SDXL example passes it: the checkpoint through DiffSynth's own
    converter (kohya-style `lora_unet_*` names with alphas), which its `pipe.load_lora` reads back into the UNet."""
    root, flags = world
    if flags["module"] != "stable_diffusion_xl":
        pytest.skip("SDXL's example converts its LoRA")
    # modules DiffSynth's converter names, as its example's --lora_target_modules lists them
    targets = ",".join(f"down_blocks.1.attentions.0.transformer_blocks.0.{a}.{m}" for a in ("attn1", "attn2")
                       for m in ("to_q", "to_k", "to_v", "to_out.0"))
    result = run(_args(root, flags, num_epochs=1, learning_rate=1e-2, lora_target_modules=targets,
                       align_to_opensource_format=True, output_path=str(tmp_path / "out")))
    lora = load_file(str(result.last_checkpoint))
    assert lora and all(k.startswith("lora_unet_input_blocks_4_1_") for k in lora)
    assert sum(k.endswith(".alpha") for k in lora) == 8 and sum(k.endswith(".lora_up.weight") for k in lora) == 8
    setup = ds_run.setup(_args(root, flags))
    pipe = setup.load(["unet"], "the check")
    before = {k: v.clone() for k, v in pipe.unet.state_dict().items()}
    pipe.load_lora(pipe.unet, str(result.last_checkpoint))
    changed = {k for k, v in pipe.unet.state_dict().items() if k in before and not torch.equal(v, before[k])}
    assert changed and all(k.startswith("down_blocks.1.attentions.0.transformer_blocks.0.") for k in changed)
    with pytest.raises(BackendError, match="converts no LoRA to an open-source layout"):
        run(_args(root, flags, pipeline="diffsynth:stable_diffusion", align_to_opensource_format=True,
                  output_path=str(tmp_path / "x")))


WAN_COMMAND = r"""
accelerate launch examples/wanvideo/model_training/train.py \
  --dataset_base_path data/diffsynth_example_dataset/wanvideo/Wan2.1-T2V-1.3B \
  --dataset_metadata_path data/diffsynth_example_dataset/wanvideo/Wan2.1-T2V-1.3B/metadata.csv \
  --height 480 \
  --width 832 \
  --dataset_repeat 100 \
  --model_id_with_origin_paths "Wan-AI/Wan2.1-T2V-1.3B:diffusion_pytorch_model*.safetensors,Wan-AI/Wan2.1-T2V-1.3B:models_t5_umt5-xxl-enc-bf16.pth,Wan-AI/Wan2.1-T2V-1.3B:Wan2.1_VAE.pth" \
  --learning_rate 1e-4 \
  --num_epochs 5 \
  --remove_prefix_in_ckpt "pipe.dit." \
  --output_path "./models/train/Wan2.1-T2V-1.3B_lora" \
  --lora_base_model "dit" \
  --lora_target_modules "q,k,v,o,ffn.0,ffn.2" \
  --lora_rank 32
"""


def _wan_argv() -> list[str]:
    import shlex

    argv = shlex.split(WAN_COMMAND.replace("\\\n", " "))
    return argv[argv.index("examples/wanvideo/model_training/train.py") + 1:]


def test_diffsynths_wan_lora_command_runs_as_it_is(tmp_path, monkeypatch, capsys):
    """DiffSynth's examples/wanvideo/model_training/lora/Wan2.1-T2V-1.3B.sh with `unitgraph train` for `accelerate
    launch .../train.py` and `--pipeline diffsynth:wan_video` (the model id alone chooses unitgraph's own Wan family,
    the documented default); only sizes are lowered (--height/--width, --num_epochs, --dataset_repeat, and 5-frame
    clips). Its .pth text encoder and VAE are read where DiffSynth's from_pretrained redirects them: its own
    safetensors copies (no pickle is opened). A validation prompt draws a clip through WanVideoPipeline.__call__."""
    from clitools import cli

    monkeypatch.chdir(tmp_path)
    for name in ("DIFFSYNTH_MODEL_BASE_PATH", "DIFFSYNTH_SKIP_DOWNLOAD"):
        monkeypatch.delenv(name, raising=False)
    write_tiny_models(tmp_path / "models", "wan_video")
    data = tmp_path / "data" / "diffsynth_example_dataset" / "wanvideo" / "Wan2.1-T2V-1.3B"
    write_synthetic_dataset(data, count=2, size=40, videos=("video",), frames=5)
    argv = _wan_argv()
    for flag, value in (("--num_epochs", "1"), ("--dataset_repeat", "1"), ("--height", "32"), ("--width", "32")):
        argv[argv.index(flag) + 1] = value
    code, out, err = cli(capsys, "train", *argv, "--pipeline", "diffsynth:wan_video", "--data_file_keys", "video",
                         "--validation_prompt", "a red circle", "--validation_inference_steps", "2")
    assert code == 0, err
    assert "pipeline: diffsynth:wan_video (DiffSynth's WanVideoPipeline; --pipeline)" in out
    assert "InputVideoEmbedder: planned for input_latents only" in out
    assert "stage 2 runs NoiseInitializer (dit)" in out
    folder = tmp_path / "models" / "train" / "Wan2.1-T2V-1.3B_lora"
    lora = load_file(str(folder / "epoch-0.safetensors"))
    assert any(".ffn.0.lora_A." in k for k in lora) and not any(k.startswith("pipe.") for k in lora)
    import imageio.v3 as iio

    clip = iio.imread(folder / "samples" / "epoch-0" / "0.mp4")
    assert clip.shape[0] >= 1 and clip.shape[1:3] == (32, 32)
    assert not (tmp_path / "models" / "Wan-AI" / "Wan2.1-T2V-1.3B" / "models_t5_umt5-xxl-enc-bf16.pth").exists()


def test_the_dry_run_of_the_released_wan_needs_no_file(tmp_path, monkeypatch, capsys):
    """The same command, --dry_run, nothing downloaded: Wan 2.1 T2V 1.3B at its released sizes from DiffSynth's table
    (the redirected .pth files sized as the releases its table names); the T5 encoder and the VAE go to stage 1."""
    import json

    from clitools import cli

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("DIFFSYNTH_SKIP_DOWNLOAD", "True")
    monkeypatch.delenv("DIFFSYNTH_MODEL_BASE_PATH", raising=False)
    code, out, err = cli(capsys, "train", *_wan_argv(), "--pipeline", "diffsynth:wan_video", "--dry_run", "--json")
    assert code == 0, err
    plan = json.loads(out[out.index("{"):])
    models, stages = plan["models"], plan["stages"]
    assert 1.3e9 < models["dit"]["params"] < 1.5e9 and 5.5e9 < models["text_encoder"]["params"] < 5.8e9
    assert stages["data_process"]["models"] == ["text_encoder", "vae"] and stages["train"]["models"] == ["dit"]
    assert not (tmp_path / "models").exists()


FLUX2_SPLIT_COMMANDS = r"""
accelerate launch examples/flux2/model_training/train.py \
  --dataset_base_path data/example_image_dataset \
  --dataset_metadata_path data/example_image_dataset/metadata.csv \
  --max_pixels 1048576 \
  --dataset_repeat 1 \
  --model_id_with_origin_paths "black-forest-labs/FLUX.2-klein-4B:text_encoder/*.safetensors,black-forest-labs/FLUX.2-klein-4B:vae/diffusion_pytorch_model.safetensors" \
  --tokenizer_path "black-forest-labs/FLUX.2-klein-4B:tokenizer/" \
  --learning_rate 1e-4 \
  --num_epochs 5 \
  --remove_prefix_in_ckpt "pipe.dit." \
  --output_path "./models/train/FLUX.2-klein-base-4B_lora_cache" \
  --lora_base_model "dit" \
  --lora_target_modules "to_q,to_k,to_v,to_out.0,add_q_proj,add_k_proj,add_v_proj,to_add_out,linear_in,linear_out,to_qkv_mlp_proj,single_transformer_blocks.0.attn.to_out,single_transformer_blocks.1.attn.to_out,single_transformer_blocks.2.attn.to_out,single_transformer_blocks.3.attn.to_out,single_transformer_blocks.4.attn.to_out,single_transformer_blocks.5.attn.to_out,single_transformer_blocks.6.attn.to_out,single_transformer_blocks.7.attn.to_out,single_transformer_blocks.8.attn.to_out,single_transformer_blocks.9.attn.to_out,single_transformer_blocks.10.attn.to_out,single_transformer_blocks.11.attn.to_out,single_transformer_blocks.12.attn.to_out,single_transformer_blocks.13.attn.to_out,single_transformer_blocks.14.attn.to_out,single_transformer_blocks.15.attn.to_out,single_transformer_blocks.16.attn.to_out,single_transformer_blocks.17.attn.to_out,single_transformer_blocks.18.attn.to_out,single_transformer_blocks.19.attn.to_out" \
  --lora_rank 32 \
  --use_gradient_checkpointing \
  --task "sft:data_process"

accelerate launch examples/flux2/model_training/train.py \
  --dataset_base_path "./models/train/FLUX.2-klein-base-4B_lora_cache" \
  --max_pixels 1048576 \
  --dataset_repeat 50 \
  --model_id_with_origin_paths "black-forest-labs/FLUX.2-klein-base-4B:transformer/*.safetensors" \
  --tokenizer_path "black-forest-labs/FLUX.2-klein-4B:tokenizer/" \
  --learning_rate 1e-4 \
  --num_epochs 5 \
  --remove_prefix_in_ckpt "pipe.dit." \
  --output_path "./models/train/FLUX.2-klein-base-4B_lora" \
  --lora_base_model "dit" \
  --lora_target_modules "to_q,to_k,to_v,to_out.0,add_q_proj,add_k_proj,add_v_proj,to_add_out,linear_in,linear_out,to_qkv_mlp_proj,single_transformer_blocks.0.attn.to_out,single_transformer_blocks.1.attn.to_out,single_transformer_blocks.2.attn.to_out,single_transformer_blocks.3.attn.to_out,single_transformer_blocks.4.attn.to_out,single_transformer_blocks.5.attn.to_out,single_transformer_blocks.6.attn.to_out,single_transformer_blocks.7.attn.to_out,single_transformer_blocks.8.attn.to_out,single_transformer_blocks.9.attn.to_out,single_transformer_blocks.10.attn.to_out,single_transformer_blocks.11.attn.to_out,single_transformer_blocks.12.attn.to_out,single_transformer_blocks.13.attn.to_out,single_transformer_blocks.14.attn.to_out,single_transformer_blocks.15.attn.to_out,single_transformer_blocks.16.attn.to_out,single_transformer_blocks.17.attn.to_out,single_transformer_blocks.18.attn.to_out,single_transformer_blocks.19.attn.to_out" \
  --lora_rank 32 \
  --use_gradient_checkpointing \
  --task "sft:train"
"""


def _flux2_argvs() -> list[list[str]]:
    import shlex

    script = "examples/flux2/model_training/train.py"
    return [(argv := shlex.split(part.replace("\\\n", " ")))[argv.index(script) + 1:]
            for part in FLUX2_SPLIT_COMMANDS.strip().split("\n\n")]


def test_diffsynths_flux2_split_training_commands_run_as_they_are(tmp_path, monkeypatch, capsys):
    """DiffSynth's examples/flux2/model_training/special/split_training/FLUX.2-klein-base-4B_lora.sh, both of its
    commands, with `unitgraph train` for `accelerate launch .../train.py` and `--pipeline diffsynth:flux2_image` (the
    model ids alone choose unitgraph's own FLUX.2 family, the documented default); only sizes are lowered
    (--num_epochs, --dataset_repeat). Stage 1 names klein-4B's text encoder and VAE and no DiT; stage 2 names only
    klein-base-4B's DiT and trains it from the cache, the text encoder's folder gone. Its LoRA list names 20 single
    blocks; the test-sized DiT has one, and the names that match nothing are left alone, as in DiffSynth's run."""
    from clitools import cli

    monkeypatch.chdir(tmp_path)
    for name in ("DIFFSYNTH_MODEL_BASE_PATH", "DIFFSYNTH_SKIP_DOWNLOAD"):
        monkeypatch.delenv(name, raising=False)
    write_tiny_models(tmp_path / "models", "flux2_image")
    write_synthetic_dataset(tmp_path / "data" / "example_image_dataset", count=2, size=40)
    stage_1, stage_2 = _flux2_argvs()
    for argv in (stage_1, stage_2):
        for flag, value in (("--num_epochs", "1"), ("--dataset_repeat", "1")):
            argv[argv.index(flag) + 1] = value
    code, out, err = cli(capsys, "train", *stage_1, "--pipeline", "diffsynth:flux2_image")
    assert code == 0, err
    assert "stage 1 runs" in out and "(text_encoder_qwen3, vae)" in out
    shutil.move(str(tmp_path / "models" / "black-forest-labs" / "FLUX.2-klein-4B" / "text_encoder"),
                str(tmp_path / "gone"))
    code, out, err = cli(capsys, "train", *stage_2, "--pipeline", "diffsynth:flux2_image")
    assert code == 0, err
    assert "stage 2 runs NoiseInitializer (dit)" in out and "stage 2 (train): 2 steps" in out
    lora = load_file(str(tmp_path / "models" / "train" / "FLUX.2-klein-base-4B_lora" / "epoch-0.safetensors"))
    assert any("single_transformer_blocks.0.attn.to_out.lora_A." in k for k in lora)
    assert any(".to_qkv_mlp_proj.lora_B." in k for k in lora) and not any(k.startswith("pipe.") for k in lora)


def test_the_dry_run_of_the_released_flux2_klein_needs_no_file(tmp_path, monkeypatch, capsys):
    """DiffSynth's FLUX.2 [klein] 4B LoRA command, --dry_run, nothing downloaded: its Qwen3-4B text encoder, which
    DiffSynth's table knows by Z-Image-Turbo's example (the glue's `sized_as`), not as FLUX.2-dev's 24 B Mistral of
    the same file pattern; the base model's DiT sized as klein's (the repository sharing the longest name)."""
    import json

    from clitools import cli

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("DIFFSYNTH_SKIP_DOWNLOAD", "True")
    monkeypatch.delenv("DIFFSYNTH_MODEL_BASE_PATH", raising=False)
    stage_1, stage_2 = _flux2_argvs()
    ids = ",".join([stage_1[stage_1.index("--model_id_with_origin_paths") + 1],
                    stage_2[stage_2.index("--model_id_with_origin_paths") + 1]])
    argv = list(stage_2)
    argv[argv.index("--model_id_with_origin_paths") + 1] = ids
    argv[argv.index("--task") + 1] = "sft"
    code, out, err = cli(capsys, "train", *argv, "--pipeline", "diffsynth:flux2_image", "--dry_run", "--json")
    assert code == 0, err
    plan = json.loads(out[out.index("{"):])
    models, stages = plan["models"], plan["stages"]
    assert 3.8e9 < models["dit"]["params"] < 4.0e9 and 3.9e9 < models["text_encoder_qwen3"]["params"] < 4.1e9
    assert "text_encoder" not in models
    assert stages["data_process"]["models"] == ["text_encoder_qwen3", "vae"] and stages["train"]["models"] == ["dit"]
    assert not (tmp_path / "models").exists()
