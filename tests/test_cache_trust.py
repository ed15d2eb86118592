"""A cache you can trust (docs/cache.md), in process on test-size models: precise invalidation, integrity,
no code execution from data, clear errors for bad input, loss sanity.

The multi-process and SIGKILL tests are in test_cache_processes.py.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("diffusers")
pytest.importorskip("accelerate")
pytest.importorskip("peft")

from clitools import cli, one_error_line  # noqa: E402
from PIL import Image  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

from unitgraph.backends.diffusion.cache import cache as cache_module, keys as cache_keys  # noqa: E402
from unitgraph.backends.diffusion.errors import BackendError  # noqa: E402
from unitgraph.backends.diffusion.args import make_args
from unitgraph.backends.diffusion.cache.cache import Cache  # noqa: E402
from unitgraph.backends.diffusion.cache.entries import read_entry
from unitgraph.backends.diffusion.data.dataset import write_synthetic_dataset  # noqa: E402
from unitgraph.backends.diffusion.family import SinkCode, UnitCode, unit  # noqa: E402
from unitgraph.backends.diffusion.stages import run  # noqa: E402
from unitgraph.backends.diffusion.train.loop import read_loss_csv  # noqa: E402

SIZE = 64
REPO = Path(__file__).resolve().parents[1]
STAGE1_UNITS = 5  # ShapeChecker, ImageEncoder, EditImageEncoder, PromptEncoder, PosteriorMean (LoRA on the DiT)


def make_data(folder: Path, count: int = 4, seed: int = 3) -> Path:
    write_synthetic_dataset(folder, count=count, size=SIZE, seed=seed, edit=True, distill=True)
    return folder


def common(tiny: Path, data: Path, **extra) -> dict:
    kwargs = dict(dataset_base_path=str(data), dataset_metadata_path=str(data / "metadata.csv"), model_paths=str(tiny),
                  lora_base_model="dit", lora_target_modules="to_q,to_k,to_v,to_out.0", lora_rank=4,
                  max_pixels=SIZE * SIZE, seed=7, learning_rate=1e-3, progress=False, plot=False)
    kwargs.update(extra)
    return kwargs


def quiet(_text: str) -> None:
    pass


def cli_args(tiny: Path, data: Path, task: str, out: Path, *extra: str) -> list[str]:
    return ["train", "--task", task, "--dataset_base_path", str(data), "--dataset_metadata_path", str(data / "metadata.csv"),
            "--model_paths", str(tiny), "--lora_base_model", "dit", "--lora_target_modules", "to_q,to_k,to_v,to_out.0",
            "--lora_rank", "4", "--max_pixels", str(SIZE * SIZE), "--output_path", str(out), "--no-progress", "--no-plot", *extra]


def tree(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()} if folder.exists() else {}


def rewrite_metadata(data: Path, change) -> None:
    import csv

    path = data / "metadata.csv"
    rows = list(csv.DictReader(path.read_text(encoding="utf-8").splitlines()))
    change(rows)
    with path.open("w", newline="", encoding="utf-8") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


# ------------------------------------------------------------------------------------------------
# 1. precise invalidation


def test_every_unit_declares_the_settings_it_reads():
    """A unit's settings are declared with it, and only known ones: a typo cannot drop a setting from the key."""
    from unitgraph.backends.diffusion.family import SETTINGS
    from unitgraph.backends.diffusion.registry import families

    units = [u for family in families() for pipeline in family.pipelines for u in pipeline.units]
    assert units and all(isinstance(u, UnitCode) and set(u.settings) <= set(SETTINGS) for u in units)
    assert {u.name: u.settings for u in units}["ShapeChecker"] == ("image_size", "dtype", "cache_dtype")
    with pytest.raises(ValueError, match="unknown settings"):
        unit("Typo", inputs=("x",), outputs=("y",), settings=("imagesize",))(lambda ctx, x: {"y": x})


def test_invalidation_recomputes_exactly_what_changed(tiny, tmp_path, monkeypatch):
    data = make_data(tmp_path / "data")
    cache = tmp_path / "cache"
    calls: list[str] = []
    real_call = UnitCode.__call__

    def counting_call(self, ctx, inputs):
        calls.append(self.name)
        return real_call(self, ctx, inputs)

    monkeypatch.setattr(UnitCode, "__call__", counting_call)
    hashed: list[Path] = []
    real_sha = cache_keys.sha256_file

    def counting_sha(path):
        hashed.append(Path(path))
        return real_sha(path)

    monkeypatch.setattr(cache_keys, "sha256_file", counting_sha)  # the weights' digests (HashMemo)
    monkeypatch.setattr(cache_module, "sha256_file", counting_sha)  # the entries' checksums
    old = time.time() - 3600  # a weights file written a moment ago may still change unseen: its hash is trusted later
    for path in tiny.rglob("*"):
        os.utime(path, (old, old))
    state = {"models": tiny, "extra": {}}

    def stage1(**extra):
        calls.clear()
        hashed.clear()
        kwargs = common(state["models"], data, **{**state["extra"], **extra})
        result = run(make_args(task="sft:data_process", output_path=str(cache), **kwargs), echo=quiet)
        assert len(calls) == STAGE1_UNITS * len(result.computed_indices)  # each recomputed sample runs every stage-1 unit once
        return result

    first = stage1()
    assert first.computed_indices == [0, 1, 2, 3] and not first.cache_reused
    memo = json.loads((cache / "hashes.json").read_text())["files"]
    assert any(name.endswith("vae/diffusion_pytorch_model.safetensors") for name in memo)

    # training settings are not stage-1 inputs: the whole cache is reused, no model file is hashed again
    same = stage1(learning_rate=0.5, lora_rank=16, num_epochs=3, seed=11, dataset_repeat=5, lora_target_modules="to_q")
    assert same.computed_indices == [] and same.cache_reused and calls == [] and same.entries_reused == 4
    assert not [p for p in hashed if tiny in p.parents]

    # one caption: exactly that sample
    rewrite_metadata(data, lambda rows: rows[1].update(prompt="a completely different caption"))
    assert stage1().computed_indices == [1]

    # a column no stage-1 unit reads (sft never reads `seed`): nothing
    rewrite_metadata(data, lambda rows: rows[2].update(seed="12345"))
    assert stage1().computed_indices == []

    # one image's pixels: exactly that sample
    image = data / "images" / "003.png"
    with Image.open(image) as img:
        img.convert("RGB").rotate(90).save(image)
    assert stage1().computed_indices == [3]

    # --max_pixels: everything, and the run says why
    state["extra"] = {"max_pixels": 32 * 32}
    result = stage1()
    assert result.computed_indices == [0, 1, 2, 3] and "--max_pixels 1024 now, --max_pixels 4096 in the cache" in result.stage1_reason
    assert len(list((cache / "entries").iterdir())) == 4  # the old entries are gone

    # the VAE's weights: everything
    changed = tmp_path / "models"
    shutil.copytree(tiny, changed)
    weights_file = changed / "vae" / "diffusion_pytorch_model.safetensors"
    weights = load_file(str(weights_file))
    name = sorted(weights)[0]
    weights[name] = weights[name] + 0.01
    save_file(weights, str(weights_file), metadata={"format": "pt"})
    state["models"] = changed
    result = stage1()
    assert result.computed_indices == [0, 1, 2, 3] and "vae weights differ" in result.stage1_reason

    # a dataset input stage 1 starts reading (the edit images): every sample that has one
    state["extra"] = {**state["extra"], "extra_inputs": "edit_image"}
    assert stage1().computed_indices == [0, 1, 2, 3]
    assert stage1().computed_indices == []

    # stage 2 refuses a cache that does not match its settings, before the first step, saying what changed
    def train(**extra):
        kwargs = common(state["models"], data, **{**state["extra"], **extra})
        kwargs.update(dataset_base_path=str(cache), dataset_metadata_path=None)
        return run(make_args(task="sft:train", output_path=str(tmp_path / "train"), **kwargs), echo=quiet)

    with pytest.raises(BackendError, match=r"--max_pixels 4096 now, --max_pixels 1024 in the cache.*sft:data_process.*sft:split"):
        train(max_pixels=SIZE * SIZE)
    with pytest.raises(BackendError, match=r"--extra_inputs \(none\) now, edit_image in the cache"):
        train(extra_inputs=None)
    with pytest.raises(BackendError, match=r"vae weights differ from the cache's \(vae/diffusion_pytorch_model.safetensors\)"):
        train(model_paths=str(tiny))
    assert not (tmp_path / "train").exists()  # stopped before writing anything
    assert train().steps == 4


# ------------------------------------------------------------------------------------------------
# 3. integrity: verify, a damaged entry stops stage 2 naming the sample, repair recomputes just it, info


def test_integrity_verify_repair_info(tiny, tmp_path, capsys):
    data = make_data(tmp_path / "data", count=5, seed=4)
    cache = tmp_path / "cache"
    code, out, err = cli(capsys, *cli_args(tiny, data, "sft:data_process", cache))
    assert code == 0, err
    code, out, err = cli(capsys, "cache", "verify", str(cache))
    assert code == 0 and out.startswith("ok: 5 samples, 5 entries"), (out, err)
    manifest = json.loads((cache / "manifest.json").read_text())
    samples = {s["index"]: s for s in manifest["samples"]}
    original = tree(cache / "entries")

    def entry(i: int) -> Path:
        return cache / manifest["entries"][samples[i]["key"]]["file"]

    # a flipped byte (same size): caught by the checksum, named by sample
    blob = bytearray(entry(2).read_bytes())
    blob[len(blob) - 10] ^= 0xFF
    entry(2).write_bytes(bytes(blob))
    code, out, err = cli(capsys, *cli_args(tiny, cache, "sft:train", tmp_path / "train"), "--dataset_metadata_path", "")
    one_error_line(code, err, "sample 2 (metadata row 3", "corrupted", "cache repair")
    assert not (tmp_path / "train" / "loss.csv").exists()  # stopped before the first step

    # a truncated entry too
    entry(4).write_bytes(entry(4).read_bytes()[:100])
    code, out, err = cli(capsys, "cache", "verify", str(cache))
    assert code == 1
    problems = [line for line in err.splitlines() if "sample" in line and "entries/" in line]
    assert len(problems) == 2 and "sample 2" in problems[0] and "checksum" in problems[0]
    assert "sample 4" in problems[1] and "truncated" in problems[1]
    code, out, err = cli(capsys, *cli_args(tiny, cache, "sft:train", tmp_path / "train"), "--dataset_metadata_path", "")
    one_error_line(code, err, "sample 4 (metadata row 5", "truncated")

    # repair recomputes exactly those two entries, bit for bit
    code, out, err = cli(capsys, "cache", "repair", str(cache))
    assert code == 0 and "recomputed 2 entries (samples 2, 4); 3 valid entries kept" in out, (out, err)
    assert tree(cache / "entries") == original
    code, out, err = cli(capsys, "cache", "verify", str(cache))
    assert code == 0, err
    code, out, err = cli(capsys, "cache", "repair", str(cache))
    assert code == 0 and "nothing to repair" in out

    # info: samples, bytes (per sample, per entry key), plan, models, settings
    code, out, err = cli(capsys, "cache", "info", str(cache))
    assert code == 0, err
    for fragment in ("samples:      5", "bytes:", "per sample", "input_latents", "prompt_emb", manifest["plan_fingerprint"],
                     "ShapeChecker", "vae/diffusion_pytorch_model.safetensors", "image_size", "max_pixels"):
        assert fragment in out, fragment
    code, out, err = cli(capsys, "cache", "info", str(cache), "--json")
    info = json.loads(out)
    assert info["samples"] == 5 and info["bytes"] == sum(len(b) for b in original.values())
    assert info["bytes_per_sample_by_key"]["input_latents"] > 0 and set(info["models"]) == {"vae", "text_encoder", "tokenizer"}
    code, _, err = cli(capsys, "cache", "verify", str(tmp_path / "nowhere"))
    one_error_line(code, err, "no such cache folder")


# ------------------------------------------------------------------------------------------------
# 4. no code execution from data


def _python_sources() -> list[Path]:
    return [p for folder in ("unitgraph", "backends", "cli") for p in sorted((REPO / folder).rglob("*.py"))]


def test_source_never_unpickles_or_evals():
    forbidden = [
        (re.compile(r"^\s*(import|from)\s+(pickle|cPickle|_pickle|dill|joblib|marshal|shelve)\b", re.M), "pickle-family import"),
        (re.compile(r"\b(pickle|cPickle|dill|joblib|marshal)\.loads?\("), "unpickling call"),
        (re.compile(r"(?<![\w.])(eval|exec)\("), "eval/exec"),
        (re.compile(r"allow_pickle\s*=\s*True"), "numpy allow_pickle"),
    ]
    problems = []
    sources = _python_sources()
    assert len(sources) > 20
    for path in sources:
        text = path.read_text(encoding="utf-8")
        for pattern, what in forbidden:
            for match in pattern.finditer(text):
                problems.append(f"{path.relative_to(REPO)}:{text[:match.start()].count(chr(10)) + 1}: {what}")
        for match in re.finditer(r"torch\.load\(", text):
            call = text[match.end(): match.end() + 300].split(")")[0]
            if "weights_only=True" not in call:
                problems.append(f"{path.relative_to(REPO)}:{text[:match.start()].count(chr(10)) + 1}: torch.load without weights_only=True")
    assert problems == []


def test_pickle_files_in_a_cache_are_ignored_with_a_warning(tiny, tmp_path, capsys):
    data = make_data(tmp_path / "data", count=2, seed=5)
    cache = tmp_path / "cache"
    code, _, err = cli(capsys, *cli_args(tiny, data, "sft:data_process", cache))
    assert code == 0, err
    (cache / "evil.pkl").write_bytes(b"\x80\x04not really a pickle")
    (cache / "entries" / "model.pth").write_bytes(b"PK\x03\x04 not a torch file")
    for argv in (cli_args(tiny, cache, "sft:train", tmp_path / "train", "--dataset_metadata_path", ""),
                 ["cache", "verify", str(cache)], ["cache", "info", str(cache)]):
        code, out, err = cli(capsys, *argv)
        assert code == 0, err
        text = out + err
        assert "warning: ignoring" in text and "evil.pkl" in text and "model.pth" in text, text
    assert (tmp_path / "train" / "epoch-0.safetensors").is_file()


# ------------------------------------------------------------------------------------------------
# 6. bad input: exit 2 and one line, nothing half-written; per-sample problems are skipped and counted


def test_bad_input_stops_with_one_line_and_writes_nothing(tiny, tmp_path, capsys):
    data = make_data(tmp_path / "data", count=2, seed=6)
    out = tmp_path / "out"

    def stops(argv, *fragments):
        code, _, err = cli(capsys, *argv)
        one_error_line(code, err, *fragments)
        assert not out.exists(), sorted(tree(out))

    base = cli_args(tiny, data, "sft:data_process", out)

    def with_option(argv, name, value):
        argv = list(argv)
        argv[argv.index(name) + 1] = value
        return argv

    stops(with_option(base, "--dataset_metadata_path", str(data / "nope.csv")), "nope.csv", "metadata file does not exist")
    (data / "no_image.csv").write_text("file,prompt\nimages/000.png,a cat\n")
    stops(with_option(base, "--dataset_metadata_path", str(data / "no_image.csv")), "no_image.csv", "missing column 'image'")
    (data / "no_prompt.csv").write_text("image,caption\nimages/000.png,a cat\n")
    stops(with_option(base, "--dataset_metadata_path", str(data / "no_prompt.csv")), "no_prompt.csv", "missing column 'prompt'")
    stops(with_option(base, "--model_paths", "[not json"), "--model_paths is not valid JSON")
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / "notes.txt").write_text("hello")
    stops(with_option(base, "--model_paths", str(tmp_path / "plain")), str(tmp_path / "plain"), "not a diffusers/transformers model folder")
    stops(with_option(base, "--model_paths", json.dumps([str(tiny / "vae")])), str(tiny / "vae"), "text_encoder needs")
    stops(with_option(base, "--lora_base_model", "unet"), "--lora_base_model 'unet' is not a model of pipeline qwen_image")
    stops(base + ["--trainable_models", "vea"], "'vea' is not a model of pipeline")

    # a cache folder that holds another plan's cache is left exactly as it was
    cache = tmp_path / "cache"
    code, _, err = cli(capsys, *cli_args(tiny, data, "sft:data_process", cache))
    assert code == 0, err
    before = tree(cache)
    code, _, err = cli(capsys, *cli_args(tiny, data, "sft:data_process", cache, "--trainable_models", "text_encoder"))
    one_error_line(code, err, str(cache), "holds the cache of another plan", "backward ['dit']", "--cache_path")
    assert tree(cache) == before

    # a LoRA checkpoint whose keys match no module: stops before training writes anything
    save_file({"transformer.not_a_module.lora_A.weight": torch.zeros(4, 8)}, str(tmp_path / "lora.safetensors"))
    train = tmp_path / "train"
    code, _, err = cli(capsys, *cli_args(tiny, cache, "sft:train", train, "--dataset_metadata_path", "",
                                         "--lora_checkpoint", str(tmp_path / "lora.safetensors")))
    one_error_line(code, err, "lora.safetensors", "matches a LoRA module of dit")
    assert not train.exists()


def test_bad_samples_are_skipped_with_a_warning_and_a_count(tiny, tmp_path, capsys):
    data = make_data(tmp_path / "data", count=4, seed=7)
    Image.new("RGB", (12, 40), (1, 2, 3)).save(data / "images" / "tiny.png")
    (data / "images" / "garbage.png").write_bytes(b"this is not an image at all")
    good = (data / "images" / "000.png").read_bytes()
    (data / "images" / "cut.png").write_bytes(good[: len(good) // 2])
    with (data / "metadata.csv").open("a", encoding="utf-8") as handle:
        handle.write("images/missing.png,a ghost,,4,2,1.0\nimages/tiny.png,a speck,,5,2,1.0\n"
                     "images/garbage.png,noise,,6,2,1.0\nimages/cut.png,half an image,,7,2,1.0\n")
    cache = tmp_path / "cache"
    code, out, err = cli(capsys, *cli_args(tiny, data, "sft:data_process", cache))
    assert code == 0, err
    warnings = [line for line in err.splitlines() if line.startswith("warning: skipping sample")]
    assert len(warnings) == 4, err  # warnings go to stderr, the results to stdout
    assert not any(line.startswith("warning:") for line in out.splitlines())
    for index, fragment in ((4, "missing file 'images/missing.png'"), (5, "12x40 px, smaller than 16 px"),
                            (6, "'garbage.png' (column 'image') is not a readable image"),
                            (7, "'cut.png' (column 'image') is not a readable image")):
        assert any(f"sample {index}:" in w and fragment in w for w in warnings), (index, fragment, warnings)
    assert "skipped:    4 samples" in out and "stage 1 (data_process): 4 samples" in out
    manifest = json.loads((cache / "manifest.json").read_text())
    assert [s["index"] for s in manifest["samples"]] == [0, 1, 2, 3]
    assert [s["index"] for s in manifest["skipped"]] == [4, 5, 6, 7]
    # the unsplit run skips the same samples, so both train on the same data
    result = run(make_args(task="sft", output_path=str(tmp_path / "sft"), **common(tiny, data)), echo=quiet)
    assert [s["index"] for s in result.skipped] == [4, 5, 6, 7] and result.steps == 4
    # nothing usable at all is an error
    (data / "none.csv").write_text("image,prompt\nimages/missing.png,a ghost\n")
    code, _, err = cli(capsys, *cli_args(tiny, data, "sft:data_process", tmp_path / "c2"), "--dataset_metadata_path",
                       str(data / "none.csv"))
    one_error_line(code, err, "no usable samples: all 1 were skipped", "missing file")
    assert not (tmp_path / "c2").exists()


def test_a_stop_while_computing_keeps_finished_entries(tiny, tmp_path, capsys):
    data = make_data(tmp_path / "data", count=5, seed=8)
    import csv

    rows = list(csv.DictReader((data / "metadata.csv").read_text().splitlines()))
    rows[3]["prompt"] = 5  # jsonl keeps the type: the prompt encoder refuses a number
    (data / "metadata.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    cache = tmp_path / "cache"
    argv = cli_args(tiny, data, "sft:data_process", cache)
    argv[argv.index("--dataset_metadata_path") + 1] = str(data / "metadata.jsonl")
    code, _, err = cli(capsys, *argv)
    one_error_line(code, err, "stage 1 stopped at sample 3 (metadata row 4)", "prompt must be a string", "kept")
    manifest = json.loads((cache / "manifest.json").read_text())
    assert manifest["status"] == "filling"
    done = Cache(cache).read_journals()
    assert sorted(r["index"] for r in done) == [0, 1, 2]
    for record in done:
        assert Cache(cache).check_entry(record) is None
    rows[3]["prompt"] = "a fixed caption"
    (data / "metadata.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    code, out, err = cli(capsys, *argv)
    assert code == 0, err
    assert "3 entries reused" in out or "2 entries computed, 3 reused" in out, out
    assert json.loads((cache / "manifest.json").read_text())["status"] == "complete"
    code, _, err = cli(capsys, "cache", "verify", str(cache))
    assert code == 0, err


def test_a_failed_entry_write_is_one_line_and_the_entries_written_before_it_stay(tiny, tmp_path, capsys, monkeypatch):
    """A write that fails (here the third, as on a full disk) stops stage 1 with one line; every entry written
    before it is journaled and whole, the failed one is not there, and the next run computes only the rest."""
    from unitgraph.atomic import OutputError

    data = make_data(tmp_path / "data", count=6, seed=8)
    cache = tmp_path / "cache"
    real = cache_module.Cache.store_entry
    calls = []

    def store_entry(self, key, values, meta):
        calls.append(meta["index"])
        if len(calls) == 3:
            raise OutputError("cannot write (No space left on device)", source=str(self.folder / "entries" / key))
        return real(self, key, values, meta)

    monkeypatch.setattr(cache_module.Cache, "store_entry", store_entry)
    code, _, err = cli(capsys, *cli_args(tiny, data, "sft:data_process", cache, "--data_process_batch_size", "2"))
    one_error_line(code, err, "No space left on device")
    done = Cache(cache).read_journals()
    kept = sorted(r["index"] for r in done)
    assert kept == calls[:2], (kept, calls)
    assert all(Cache(cache).check_entry(record) is None for record in done)
    monkeypatch.setattr(cache_module.Cache, "store_entry", real)
    code, out, err = cli(capsys, *cli_args(tiny, data, "sft:data_process", cache, "--data_process_batch_size", "2"))
    assert code == 0 and f"{6 - len(kept)} entries computed, {len(kept)} reused" in out, (err, out)


# ------------------------------------------------------------------------------------------------
# 7. loss sanity


def test_non_finite_loss_stops_naming_step_and_sample(tiny, tmp_path, monkeypatch):
    data = make_data(tmp_path / "data", count=4, seed=9)
    real_sink = SinkCode.__call__
    seen = []

    def sink(self, ctx, inputs):
        seen.append(ctx.sample_key)
        loss = real_sink(self, ctx, inputs)
        return loss * float("nan") if len(seen) == 3 else loss

    monkeypatch.setattr(SinkCode, "__call__", sink)
    out = tmp_path / "out"
    with pytest.raises(BackendError) as exc:
        run(make_args(task="sft:split", output_path=str(out), save_steps=1, **common(tiny, data)), echo=quiet)
    message = exc.value.one_line()
    index = int(seen[2].split(":")[0])
    assert f"loss is nan at step 3 (epoch 0) on sample {index} (metadata row {index + 1}" in message
    assert "last good checkpoint is kept" in message and "step-2.safetensors" in message
    assert sorted(p.name for p in out.glob("*.safetensors")) == ["step-1.safetensors", "step-2.safetensors"]
    assert all(torch.isfinite(v).all() for v in load_file(str(out / "step-2.safetensors")).values())
    assert [r["step"] for r in read_loss_csv(out / "loss.csv")] == [1, 2]


def test_entry_meta_and_key_addressing(tiny, tmp_path):
    """Entries are content-addressed: two samples with the same stage-1 inputs share one entry."""
    data = make_data(tmp_path / "data", count=3, seed=10)
    rewrite_metadata(data, lambda rows: rows.append({**rows[0], "seed": "99"}))  # same image and caption as row 1
    result = run(make_args(task="sft:data_process", output_path=str(tmp_path / "cache"), **common(tiny, data)), echo=quiet)
    manifest = json.loads((tmp_path / "cache" / "manifest.json").read_text())
    keys = [s["key"] for s in manifest["samples"]]
    assert len(keys) == 4 and keys[0] == keys[3] and len(set(keys)) == 3
    assert result.computed_indices == [0, 1, 2] and len(manifest["entries"]) == 3
    assert manifest["samples"][0]["sample_id"] != manifest["samples"][3]["sample_id"]  # its randomness stays its own
    values, meta = read_entry(tmp_path / "cache" / manifest["entries"][keys[1]]["file"])
    assert meta == {"key": keys[1], "index": 1, "sample_id": manifest["samples"][1]["sample_id"]}
    assert set(values) == set(manifest["keys"])
