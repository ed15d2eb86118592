"""The environment and the arguments are checked where the flags are parsed, in one line naming what is wrong
(docs/safety.md): accelerate's variables, every command's seed, a schedule's floor, prompts that look like options,
and a Ctrl-C during an object-store cache's work reaches the command."""

from __future__ import annotations

import gc

import pytest
from clitools import cli, one_error_line

from unitgraph.backends.diffusion.args import MAX_SEED, make_args
from unitgraph.backends.diffusion.config import check_environment
from unitgraph.backends.diffusion.errors import BackendError
from unitgraph.cli.app import bare_resume


@pytest.mark.parametrize("name, value", [("ACCELERATE_USE_CPU", "maybe"), ("ACCELERATE_DEBUG_MODE", ""),
                                         ("ACCELERATE_USE_FSDP", " true"), ("WORLD_SIZE", "two"),
                                         ("LOCAL_RANK", "1.5")])
def test_a_variable_accelerate_would_fail_on_is_named(name, value):
    with pytest.raises(BackendError, match=f"environment variable {name}="):
        check_environment({name: value})


def test_accelerates_own_words_pass():
    check_environment({"ACCELERATE_USE_CPU": "TRUE", "ACCELERATE_DEBUG_MODE": "0", "ACCELERATE_USE_DEEPSPEED": "no",
                       "WORLD_SIZE": "2", "RANK": "", "ACCELERATE_MIXED_PRECISION": "bf16", "PATH": "/bin"})


def test_a_bad_accelerate_variable_is_one_line_before_anything_starts(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("ACCELERATE_USE_CPU", "maybe")
    code, _, err = cli(capsys, "train", "--task", "sft", "--lora_base_model", "dit", "--model_paths", str(tmp_path),
                       "--output_path", str(tmp_path / "out"))
    one_error_line(code, err, "ACCELERATE_USE_CPU='maybe'")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("command", [["tiny-models", "{tmp}/m"], ["demo", "--output_path", "{tmp}/d"]])
@pytest.mark.parametrize("seed", [str(2 ** 64), "-1"])
def test_every_commands_seed_is_bounded(command, seed, capsys, tmp_path):
    code, _, err = cli(capsys, *[a.format(tmp=tmp_path) for a in command], "--seed", seed)
    one_error_line(code, err, f"--seed must be between 0 and {MAX_SEED - 1}")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("rate", [1e-7, 1e-9])
def test_a_polynomial_schedule_needs_a_rate_above_its_floor(rate):
    with pytest.raises(BackendError, match="--lr_scheduler polynomial decays to 1e-07"):
        make_args(task="sft", lora_base_model="dit", lr_scheduler="polynomial", learning_rate=rate).validate()
    make_args(task="sft", lora_base_model="dit", lr_scheduler="polynomial", learning_rate=2e-7).validate()


@pytest.mark.parametrize("argv, expected", [
    (["train", "--validation_prompt", "--resume", "--seed", "1"], ["train", "--validation_prompt", "--resume", "--seed", "1"]),
    (["train", "--validation_prompt", "--resume"], ["train", "--validation_prompt", "--resume"]),
    (["train", "--resume", "--validation_prompt", "--resume"],
     ["train", "--resume", "latest", "--validation_prompt", "--resume"]),
    (["train", "--no-progress", "--resume"], ["train", "--no-progress", "--resume", "latest"]),
    (["train", "--resume", "out/state/step-2"], ["train", "--resume", "out/state/step-2"]),
])
def test_a_prompt_that_looks_like_an_option_stays_the_prompt(argv, expected):
    assert bare_resume(argv) == expected


def test_a_validation_prompt_beginning_with_dashes_reaches_the_run(capsys, monkeypatch):
    from unitgraph.backends.diffusion import stages

    seen = {}

    def run(args, *a, **k):
        seen.update(prompts=args.validation_prompt, resume=args.resume)
        raise BackendError("stop here")

    monkeypatch.setattr(stages, "run", run)
    for argv in (["--validation_prompt", "--resume"], ["--validation_prompt=--foo"], ["--validation_prompt", "--foo"]):
        code, _, err = cli(capsys, "train", "--task", "sft", "--lora_base_model", "dit", *argv)
        one_error_line(code, err, "stop here")
        assert seen["prompts"] in (["--resume"], ["--foo"]) and seen["resume"] is None, seen


def test_no_s3_session_finalizer_runs_while_a_command_works(s3, monkeypatch):
    """s3fs closes a session in a weakref finalizer, where a Ctrl-C is swallowed: stores share one filesystem per
    process and configuration, so no finalizer runs while a command works and KeyboardInterrupt reaches it."""
    s3fs = pytest.importorskip("s3fs")
    from unitgraph.backends.diffusion.cache import object_store
    from unitgraph.backends.diffusion.cache.object_store import ObjectStore

    finalized = []
    monkeypatch.setattr(s3fs.S3FileSystem, "close_session", staticmethod(lambda *_a: finalized.append(1)))
    monkeypatch.setattr(object_store, "_FILESYSTEMS", {})
    filesystems = set()
    for n in range(4):  # a repair makes stores as it goes: each dropped when done
        store = ObjectStore("cache", f"c{n}")
        store.write("x.json", b"{}")
        assert store.read("x.json") == b"{}"
        filesystems.add(id(store.fs))
        del store
        gc.collect()
    assert len(filesystems) == 1 and finalized == []
