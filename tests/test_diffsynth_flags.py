"""Every flag of DiffSynth-Studio's parser (diffsynth/diffusion/parsers.py, in the wheel the set-up unpacks) and of
its examples' train.py is an option of `unitgraph train`: honoured, noted as having no effect, or refused in one
line saying what unitgraph does instead (backends/diffusion/args.py, the "diffsynth" group)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from clitools import cli, one_error_line
from unitgraph.backends.diffusion.args import DIFFSYNTH_PIPELINE_FLAGS, OTHER_TASKS, REFUSED_DIFFSYNTH_FLAGS

WHEEL = Path(__file__).resolve().parent.parent / ".venv" / "diffsynth-wheel" / "diffsynth" / "diffusion" / "parsers.py"
# the extra flags of DiffSynth's examples/<family>/model_training/train.py (repository as of DiffSynth 2.1)
TRAIN_PY_FLAGS = ("align_to_opensource_format", "audio_processor_path", "enable_npu_patch", "first_frame_as_condition",
                  "frame_rate", "framewise_decoding", "initialize_model_on_cpu", "max_audio_duration",
                  "max_timestep_boundary", "min_timestep_boundary", "noise_scale", "processor_config", "processor_path",
                  "silence_latent_path", "silent_on_missing_audio", "tokenizer_1_path", "tokenizer_2_path",
                  "tokenizer_path", "tokenizer_t5xxl_path", "zero_cond_t")


def train_options() -> set[str]:
    import typer.main

    from unitgraph.cli.app import app

    command = typer.main.get_command(app).commands["train"]
    return {o for p in command.params for o in [*getattr(p, "opts", []), *getattr(p, "secondary_opts", [])]}


def test_every_flag_of_diffsynths_parser_and_train_scripts_is_an_option():
    if not WHEEL.is_file():
        pytest.skip("the diffsynth wheel is not unpacked (scripts/setup.sh)")
    parser = set(re.findall(r'add_argument\("(--[a-z0-9_]+)"', WHEEL.read_text(encoding="utf-8")))
    assert len(parser) > 60  # the whole parser was read
    missing = sorted((parser | {f"--{name}" for name in TRAIN_PY_FLAGS}) - train_options())
    assert missing == []


@pytest.mark.parametrize("flag", sorted(REFUSED_DIFFSYNTH_FLAGS))
def test_a_flag_unitgraph_cannot_honour_is_one_line_saying_what_it_does_instead(flag, tmp_path, capsys):
    value = [] if flag in ("enable_swanlab_log", "enable_lora_hot_loading", "zero_cond_t", "framewise_decoding",
                           "first_frame_as_condition", "silent_on_missing_audio") else ["x"]
    out = tmp_path / "out"
    code, _, err = cli(capsys, "train", "--dataset_base_path", str(tmp_path), "--lora_base_model", "dit",
                       "--output_path", str(out), f"--{flag}", *value)
    one_error_line(code, err, f"--{flag}: {REFUSED_DIFFSYNTH_FLAGS[flag]}")
    assert not out.exists()


@pytest.mark.parametrize("flag", sorted(DIFFSYNTH_PIPELINE_FLAGS))
def test_a_flag_of_a_diffsynth_pipeline_is_one_line_naming_it_for_unitgraphs_own_families(flag, tmp_path, capsys):
    """A flag only one of DiffSynth's own pipelines reads (HiDream-O1's --noise_scale, ACE-Step's
    --silence_latent_path, ...) given to a run of unitgraph's own families: one line naming that pipeline."""
    family, pipeline = DIFFSYNTH_PIPELINE_FLAGS[flag]
    value = "7.5" if flag in ("noise_scale", "max_audio_duration") else "x"
    out = tmp_path / "out"
    code, _, err = cli(capsys, "train", "--dataset_base_path", str(tmp_path), "--lora_base_model", "dit",
                       "--output_path", str(out), f"--{flag}", value)
    one_error_line(code, err, f"--{flag}: a flag of DiffSynth's {family}", f"--pipeline {pipeline}")
    assert not out.exists()


def test_dmd2_settings_and_other_tasks_are_named_as_not_trained(tmp_path, capsys):
    base = ["train", "--dataset_base_path", str(tmp_path), "--lora_base_model", "dit", "--output_path", str(tmp_path / "o")]
    code, _, err = cli(capsys, *base, "--dmd2_student_sample_steps", "4")
    one_error_line(code, err, "--dmd2_student_sample_steps: DMD2 distillation is DiffSynth's task")
    for task in OTHER_TASKS:
        code, _, err = cli(capsys, *base, "--task", task)
        one_error_line(code, err, f"--task {task}: ", "which unitgraph does not train", "sft and direct_distill")
    code, _, err = cli(capsys, *base, "--task", "trajectory_imitation:data_process")
    one_error_line(code, err, "trajectory imitation (Z-Image's distillation) is DiffSynth's task")
    code, _, err = cli(capsys, *base, "--tokenizer_t5xxl_path", "x")  # Anima's: read by its DiffSynth pipeline only
    one_error_line(code, err, "--tokenizer_t5xxl_path: a flag of DiffSynth's Anima, which unitgraph trains through "
                   "DiffSynth's own pipeline only (--pipeline diffsynth:anima_image")
    for flag, value in (("--max_audio_duration", "30"), ("--silence_latent_path", "x.pt")):  # ACE-Step's, alike
        code, _, err = cli(capsys, *base, flag, value)
        one_error_line(code, err, f"{flag}: a flag of DiffSynth's ACE-Step, which unitgraph trains through DiffSynth's "
                       "own pipeline only (--pipeline diffsynth:ace_step")
    code, _, err = cli(capsys, *base, "--frame_rate", "25")
    one_error_line(code, err, "unitgraph trains clips with sound at 24 fps")
    code, _, err = cli(capsys, *base, "--enable_tensorboard_log", "--report_to", "wandb")
    one_error_line(code, err, "--enable_tensorboard_log and --report_to wandb ask for different trackers")
    code, _, err = cli(capsys, *base, "--resume_from_checkpoint", "x.safetensors", "--lora_base_model", "",
                       "--trainable_models", "dit")
    one_error_line(code, err, "--resume_from_checkpoint: unitgraph starts a LoRA from a file with --lora_checkpoint")


def test_the_flags_it_honours_or_notes_say_so_and_train(tiny, tmp_path, capsys):
    from unitgraph.backends.diffusion.data.dataset import write_synthetic_dataset

    data = tmp_path / "data"
    write_synthetic_dataset(data, count=2, size=32, seed=1)
    base = ["train", "--model_paths", str(tiny), "--dataset_base_path", str(data), "--dataset_metadata_path",
            str(data / "metadata.csv"), "--lora_base_model", "dit", "--lora_rank", "4", "--max_pixels", "1024",
            "--no-progress", "--no-plot"]
    code, _, err = cli(capsys, *base, "--output_path", str(tmp_path / "first"))
    assert code == 0, err
    lora = tmp_path / "first" / "epoch-0.safetensors"
    code, out, err = cli(capsys, *base, "--output_path", str(tmp_path / "second"), "--enable_csv_log",
                         "--enable_npu_patch", "--enable_tensorboard_log", "--resume_from_checkpoint", str(lora))
    assert code == 0, err
    for said in ("note: --enable_csv_log has no effect: unitgraph always writes loss.csv",
                 "note: --enable_npu_patch has no effect", "note: --enable_tensorboard_log is read as --report_to tensorboard",
                 f"note: --resume_from_checkpoint is read as --lora_checkpoint {lora}"):
        assert said in out, out
    recorded = json.loads((tmp_path / "second" / "training_args.json").read_text())
    assert recorded["report_to"] == "tensorboard" and recorded["lora_checkpoint"] == str(lora)
    assert any((tmp_path / "second" / "logs").rglob("events.out.tfevents*"))
