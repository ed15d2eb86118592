"""Caches on an S3-compatible object store (backends/diffusion/cache/object_store.py), against a real local server: moto's standalone
server on 127.0.0.1 (tests/s3server.py), configured through the AWS_* variables only.

What a local cache guarantees must hold on the bucket too: stage 1 writes there, `cache verify|info`
read it, stage 2 trains from it with exactly the losses of a local cache, invalidation is precise,
damaged or foreign objects are refused in one line, two processes compute every entry once, a
killed stage 1 resumes, and the packed `shards` layout gives the same entries.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("diffusers")
pytest.importorskip("s3fs")

from clitools import cli, one_error_line  # noqa: E402
from unitgraph.backends.diffusion.data.dataset import write_synthetic_dataset  # noqa: E402
from unitgraph.backends.diffusion.families.qwen_image.tiny import write_tiny_models  # noqa: E402
from unitgraph.backends.diffusion.train.loop import read_loss_csv  # noqa: E402

BUCKET = "cache"
SIZE = 32
VENV_BIN = Path(sys.executable).parent
LAUNCH2 = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2", "--num_machines",
           "1", "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", "0"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("objectstore")
    models = write_tiny_models(root / "models", size="test", seed=0)
    data = root / "data"
    write_synthetic_dataset(data, count=6, size=SIZE, seed=7)
    return models, data


def stage1(models: Path, data: Path, out: str, *extra: str) -> list[str]:
    return ["train", "--task", "sft:data_process", "--model_paths", str(models), "--lora_base_model", "dit",
            "--max_pixels", str(SIZE * SIZE), "--dataset_base_path", str(data), "--dataset_metadata_path",
            str(data / "metadata.csv"), "--output_path", out, "--no-progress", "--seed", "3", *extra]


def stage2(models: Path, cache: str, out: Path, *extra: str) -> list[str]:
    return ["train", "--task", "sft:train", "--model_paths", str(models), "--lora_base_model", "dit", "--lora_rank",
            "4", "--max_pixels", str(SIZE * SIZE), "--dataset_base_path", cache, "--num_epochs", "2",
            "--learning_rate", "1e-3", "--output_path", str(out), "--no-progress", "--no-plot", "--seed", "3", *extra]


def objects(server, prefix: str) -> dict[str, bytes]:
    client = server.client()
    found = client.list_objects_v2(Bucket=BUCKET, Prefix=prefix).get("Contents", [])
    return {o["Key"][len(prefix):]: client.get_object(Bucket=BUCKET, Key=o["Key"])["Body"].read() for o in found}


def losses(out: Path) -> list[float]:
    return [r["loss"] for r in read_loss_csv(out / "loss.csv")]


@pytest.fixture(scope="module")
def local_run(tiny, tmp_path_factory):
    """The reference: stage 1 into a local folder, stage 2 from it."""
    models, data = tiny
    root = tmp_path_factory.mktemp("local")
    from unitgraph.cli.app import main

    for argv in (stage1(models, data, str(root / "cache")), stage2(models, str(root / "cache"), root / "run")):
        with pytest.raises(SystemExit) as exc:
            main(argv)
        assert not exc.value.code
    return root


def test_stage1_to_s3_then_verify_info_and_stage2_give_the_local_losses(tiny, local_run, s3, tmp_path, capsys):
    models, data = tiny
    url = f"s3://{BUCKET}/runs/a"
    code, out, err = cli(capsys, *stage1(models, data, url))
    assert code == 0, err
    assert "computing 6 entries" in out + err
    stored = objects(s3, "runs/a/")
    manifest = json.loads(stored["manifest.json"])
    assert manifest["status"] == "complete" and len(manifest["entries"]) == 6
    assert "plan.json" in stored and "training_args.json" in stored
    assert not any(name.startswith("journal/") for name in stored)  # merged into the manifest, then removed
    # the same content-keyed entries, byte for byte, as stage 1 into a local folder
    local = {p.name: p.read_bytes() for p in (local_run / "cache" / "entries").iterdir()}
    assert {k.split("/", 1)[1]: v for k, v in stored.items() if k.startswith("entries/")} == local
    assert "AWS_SECRET_ACCESS_KEY" not in stored["training_args.json"].decode() and "testing" not in \
        json.dumps(manifest["made_with"])

    code, out, err = cli(capsys, "cache", "verify", url)
    assert code == 0, err
    code, out, err = cli(capsys, "cache", "info", url)
    assert code == 0 and url in out and "6" in out, err

    code, _, err = cli(capsys, *stage2(models, url, tmp_path / "run"))
    assert code == 0, err
    assert losses(tmp_path / "run") == losses(local_run / "run")  # exactly: the same bytes were read

    # stage 2's start-up lists the prefix once (hygiene check and entry sizes from the same listing)
    from unitgraph.backends.diffusion import stages
    from unitgraph.backends.diffusion.cache import object_store as store
    from unitgraph.backends.diffusion.registry import families
    from unitgraph.plan import Plan

    listed = []
    real_list = store.ObjectStore.list

    def counted(self, prefix=""):
        listed.append(prefix)
        return real_list(self, prefix)

    store.ObjectStore.list = counted
    try:
        stages.CacheProvider(families()[0].pipeline("qwen_image"), Plan.from_dict(json.loads(stored["plan.json"])), url)
    finally:
        store.ObjectStore.list = real_list
    assert listed == [""], listed

    # a second stage 1 finds every entry valid; a changed caption recomputes exactly that sample's entry
    code, out, err = cli(capsys, *stage1(models, data, url))
    assert code == 0 and "all 6 entries valid: nothing to compute" in out + err, out + err
    changed = tmp_path / "data"
    shutil.copytree(data, changed)
    rows = (changed / "metadata.csv").read_text().splitlines()
    rows[1] = rows[1].rsplit(",", 1)[0] + ",a caption nobody wrote before"
    (changed / "metadata.csv").write_text("\n".join(rows) + "\n")
    code, out, err = cli(capsys, *stage1(models, changed, url))
    assert code == 0 and "computing 1 entry" in out + err, out + err


def test_shards_layout_packs_the_same_entries_and_stage2_streams_them(tiny, local_run, s3, tmp_path, capsys,
                                                                      monkeypatch):
    models, data = tiny
    url = f"s3://{BUCKET}/packed"
    code, _, err = cli(capsys, *stage1(models, data, url, "--cache_layout", "shards"))
    assert code == 0, err
    stored = objects(s3, "packed/")
    shards = [k for k in stored if k.startswith("shards/")]
    assert len(shards) == 1 and not any(k.startswith("entries/") for k in stored)  # one process: one shard
    manifest = json.loads(stored["manifest.json"])
    assert manifest["layout"] == "shards"
    local = {p.name[: -len(".safetensors")]: p.read_bytes() for p in (local_run / "cache" / "entries").iterdir()}
    for key, record in manifest["entries"].items():
        offset = record.get("offset", 0)
        assert stored[record["file"]][offset: offset + record["size"]] == local[key]
    code, _, err = cli(capsys, "cache", "verify", url)
    assert code == 0, err
    code, _, err = cli(capsys, *stage2(models, str(local_run / "cache"), tmp_path / "local", "--batch_size", "2"))
    assert code == 0, err
    from unitgraph.backends.diffusion import stages

    monkeypatch.setattr(stages, "KEEP_IN_MEMORY_BYTES", 0)  # streamed: ranged reads, fetched ahead of each step
    fetched_ahead = []
    take = stages.ReadAhead.take
    monkeypatch.setattr(stages.ReadAhead, "take", lambda self, key: fetched_ahead.append(take(self, key)) or fetched_ahead[-1])
    code, _, err = cli(capsys, *stage2(models, url, tmp_path / "run", "--batch_size", "2"))
    assert code == 0, err
    assert len(fetched_ahead) == 12 and all(isinstance(d, bytes) for d in fetched_ahead)  # 6 samples x 2 epochs
    assert losses(tmp_path / "run") == losses(tmp_path / "local")


def test_shards_layout_on_a_local_disk_too(tiny, local_run, tmp_path, capsys):
    models, data = tiny
    cache = tmp_path / "packed"
    code, _, err = cli(capsys, *stage1(models, data, str(cache), "--cache_layout", "shards"))
    assert code == 0, err
    assert not (cache / "entries").exists() or not any((cache / "entries").iterdir())
    assert len(list((cache / "shards").iterdir())) == 1
    code, _, err = cli(capsys, "cache", "verify", str(cache))
    assert code == 0, err
    code, _, err = cli(capsys, *stage2(models, str(cache), tmp_path / "run"))
    assert code == 0, err
    assert losses(tmp_path / "run") == losses(local_run / "run")


def test_damaged_foreign_and_unreachable_caches_are_one_line(tiny, s3, tmp_path, capsys, monkeypatch):
    models, data = tiny
    url = f"s3://{BUCKET}/b"
    code, _, err = cli(capsys, *stage1(models, data, url))
    assert code == 0, err
    client = s3.client()
    manifest = json.loads(client.get_object(Bucket=BUCKET, Key="b/manifest.json")["Body"].read())
    victim = sorted(manifest["entries"].values(), key=lambda r: r["file"])[0]
    body = client.get_object(Bucket=BUCKET, Key=f"b/{victim['file']}")["Body"].read()
    client.put_object(Bucket=BUCKET, Key=f"b/{victim['file']}", Body=body[:-1] + bytes([body[-1] ^ 1]))
    code, _, err = cli(capsys, "cache", "verify", url)
    assert code == 1 and f"s3://{BUCKET}/b/{victim['file']}" in err and "checksum" in err, err
    code, _, err = cli(capsys, *stage2(models, url, tmp_path / "run"))
    one_error_line(code, err, victim["file"], "does not match its checksum")
    code, out, err = cli(capsys, "cache", "repair", url, "--no-progress")  # recomputes only that entry
    assert code == 0 and "recomputed 1 entry" in out + err, out + err
    code, _, err = cli(capsys, "cache", "verify", url)
    assert code == 0, err

    # a prefix holding someone else's objects is refused untouched
    client.put_object(Bucket=BUCKET, Key="theirs/notes.txt", Body=b"mine")
    code, _, err = cli(capsys, *stage1(models, data, f"s3://{BUCKET}/theirs"))
    one_error_line(code, err, f"s3://{BUCKET}/theirs", "not a unitgraph cache")
    assert sorted(objects(s3, "theirs/")) == ["notes.txt"]

    code, _, err = cli(capsys, *stage1(models, data, "s3://no-such-bucket/x"))
    one_error_line(code, err, "no-such-bucket", "does not exist")
    code, _, err = cli(capsys, *stage1(models, data, "s3://AKIA:hunter2@cache/x"))
    line = one_error_line(code, err, "must not carry credentials")
    assert "hunter2" not in line
    code, _, err = cli(capsys, "cache", "verify", f"s3://{BUCKET}/nothing-here")
    one_error_line(code, err, "no manifest.json")
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")  # nothing listens there
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    code, _, err = cli(capsys, "cache", "verify", url)
    one_error_line(code, err, "cannot reach the object store")


def test_a_live_lease_refuses_a_second_filler_and_a_dead_ones_is_taken_over(tiny, s3, capsys):
    models, data = tiny
    client = s3.client()
    import socket

    lease = {"format": "unitgraph.lease/v1", "token": "x", "host": socket.gethostname(), "pid": os.getpid(),
             "renewed": time.time()}
    client.put_object(Bucket=BUCKET, Key="c/.lock", Body=json.dumps(lease).encode())
    code, _, err = cli(capsys, *stage1(models, data, f"s3://{BUCKET}/c"))
    one_error_line(code, err, "another unitgraph process is filling this cache", f"pid {os.getpid()}")
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    client.put_object(Bucket=BUCKET, Key="c/.lock", Body=json.dumps({**lease, "pid": int(dead.stdout)}).encode())
    code, _, err = cli(capsys, *stage1(models, data, f"s3://{BUCKET}/c"))
    assert code == 0, err
    assert ".lock" not in objects(s3, "c/")  # released at the end


@pytest.mark.slow
def test_two_processes_compute_each_entry_once_and_a_killed_stage1_resumes(tiny, s3, tmp_path):
    models, _ = tiny
    data = tmp_path / "data"
    # 96 samples: the killed run below is stopped at its first journal segment (32 records, or 2 s), so
    # that many leave it well inside its work even on a fast machine (with 40 it could finish first)
    count = 96
    write_synthetic_dataset(data, count=count, size=64, seed=11)
    env = {**os.environ, **s3.env(), "OMP_NUM_THREADS": "1", "ACCELERATE_USE_CPU": "true"}
    base = stage1(models, data, f"s3://{BUCKET}/multi")
    base[base.index("--max_pixels") + 1] = str(64 * 64)
    done = subprocess.run([*LAUNCH2, str(VENV_BIN / "unitgraph"), *base], capture_output=True, text=True, env=env,
                          timeout=400)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"computed {count} entries over 2 processes ({count // 2}, {count // 2})" in done.stdout + done.stderr, \
        done.stdout + done.stderr
    manifest = json.loads(objects(s3, "multi/")["manifest.json"])
    assert len(manifest["entries"]) == count and manifest["status"] == "complete"

    # one process, killed once it has recorded entries (a journal segment), then run again to the end
    killed = stage1(models, data, f"s3://{BUCKET}/killed")
    killed[killed.index("--max_pixels") + 1] = str(64 * 64)
    process = subprocess.Popen([str(VENV_BIN / "unitgraph"), *killed], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               env=env, start_new_session=True)
    deadline = time.time() + 240
    while time.time() < deadline and process.poll() is None \
            and not any(k.startswith("journal/") for k in objects(s3, "killed/")):
        time.sleep(0.1)
    assert process.poll() is None, "stage 1 ended before it could be killed"
    os.killpg(process.pid, signal.SIGKILL)
    process.wait()
    after_kill = objects(s3, "killed/")
    assert json.loads(after_kill["manifest.json"])["status"] == "filling" and ".lock" in after_kill
    again = subprocess.run([str(VENV_BIN / "unitgraph"), *killed], capture_output=True, text=True, env=env, timeout=400)
    assert again.returncode == 0, again.stderr[-3000:]
    text = again.stdout + again.stderr
    computing = re.search(r"computing (\d+) entr", text)
    assert computing and 0 < int(computing.group(1)) < count, text  # what the journal recorded was kept
    check = subprocess.run([str(VENV_BIN / "unitgraph"), "cache", "verify", f"s3://{BUCKET}/killed"],
                           capture_output=True, text=True, env=env, timeout=200)
    assert check.returncode == 0, check.stderr
    final = objects(s3, "killed/")
    assert json.loads(final["manifest.json"])["entries"].keys() == manifest["entries"].keys()
    assert not any(k.startswith("journal/") for k in final) and ".lock" not in final


def test_the_benchmark_measures_both_layouts_and_writes_its_section(s3, tmp_path):
    import importlib.util

    path = Path(__file__).resolve().parent.parent / "benchmarks" / "object_store.py"
    spec = importlib.util.spec_from_file_location("object_store_bench", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    s3.make_bucket(bench.BUCKET)
    rates = bench.layout_rates(tmp_path, entries=6, kib=1)
    assert rates["S3 server/files"]["objects"] > rates["S3 server/shards"]["objects"] >= 2  # a shard and its journal
    steps = {"samples": 4, "size": 32, "epochs": 2, "repeats": 1, "local": {"step_s": 0.02}, "s3": {"step_s": 0.021},
             "s3_no_read_ahead": {"step_s": 0.03}, "s3_vs_local": 1.05, "no_read_ahead_vs_local": 1.5}
    doc = tmp_path / "benchmarks.md"
    doc.write_text(f"# Benchmarks\n\n{bench.BEGIN}\nstale table\n{bench.END}\n\nafter\n")
    bench.write_doc(bench.report(steps, rates), doc)
    text = doc.read_text()
    assert "stale table" not in text and "| s3://, read-ahead off | 30.0 ms | 1.50 |" in text and text.endswith("after\n")
