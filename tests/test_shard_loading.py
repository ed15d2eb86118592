"""Models read straight into their FSDP2 shards (backends/diffusion/models/shards.py).

What matters: a model built without weights and filled shard by shard holds exactly the weights (and dtypes, and
buffers) `from_pretrained` gives, its LoRA starts from the very values the run draws for a model loaded whole, each
process reads only its share of the bytes, and a folder that lacks a weight is one line naming it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, strategies as st

torch = pytest.importorskip("torch")
pytest.importorskip("diffusers")
pytest.importorskip("peft")

from unitgraph.backends.diffusion.models.folders import ComponentSource, ModelLoadError  # noqa: E402
from unitgraph.backends.diffusion.models.loading import keep_in_fp32  # noqa: E402
from unitgraph.backends.diffusion.models.shards import (  # noqa: E402
    deferred, fill_shards, kept_tensors, load_skeleton, shard_rows)

JOB = Path(__file__).with_name("shard_loading_job.py")


@given(rows=st.integers(0, 300), parts=st.integers(1, 9), data=st.data())
def test_a_process_reads_the_rows_torch_chunk_gives_it(rows, parts, data):
    index = data.draw(st.integers(0, parts - 1))
    start, stop = shard_rows(rows, parts, index)
    chunks = torch.arange(rows).chunk(parts) if rows else ()
    expected = chunks[index].tolist() if index < len(chunks) else []
    assert list(range(start, stop)) == expected


def _dit(tiny: Path) -> tuple[ComponentSource, type]:
    from diffusers import QwenImageTransformer2DModel

    return (ComponentSource(slot="dit", path=tiny / "transformer", class_name="QwenImageTransformer2DModel"),
            QwenImageTransformer2DModel)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_skeleton_filled_whole_is_what_from_pretrained_loads(tiny, dtype):
    source, cls = _dit(tiny)
    dtype = getattr(torch, dtype)
    model = load_skeleton(source, cls, dtype, keep_in_fp32(cls, "diffusers", dtype))
    assert all(p.is_meta for p in model.parameters()) and deferred(model) is not None
    kept_tensors(model)
    record = fill_shards(model, "cpu")
    reference = cls.from_pretrained(str(source.path), torch_dtype=dtype)
    expected = dict([*reference.named_parameters(), *reference.named_buffers()])
    got = dict([*model.named_parameters(), *model.named_buffers()])
    assert expected.keys() == got.keys()
    for name, value in expected.items():
        assert got[name].dtype == value.dtype and torch.equal(got[name], value), name
    assert record.read_bytes == record.total_bytes > 0
    assert not model.training  # eval mode, as from_pretrained leaves it


def test_a_folder_lacking_a_weight_is_one_line_naming_it(tiny, tmp_path):
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "transformer"
    shutil.copytree(tiny / "transformer", folder)
    files = sorted(folder.glob("*.safetensors"))
    tensors = load_file(str(files[0]))
    dropped = sorted(tensors)[0]
    del tensors[dropped]
    save_file(tensors, str(files[0]), metadata={"format": "pt"})
    _, cls = _dit(tiny)
    with pytest.raises(ModelLoadError) as err:
        load_skeleton(ComponentSource(slot="dit", path=folder, class_name=cls.__name__), cls, torch.float32, set())
    assert dropped in str(err.value) and str(folder) in str(err.value) and "\n" not in str(err.value)


@pytest.mark.slow
def test_two_processes_read_half_each_straight_into_fsdp2_shards_with_the_lora_of_a_whole_load(tiny, tmp_path):
    out = tmp_path / "report.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ACCELERATE_", "FSDP_"))}
    env["OMP_NUM_THREADS"] = "1"
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           str(JOB), str(tiny), "float32,bfloat16", str(out)], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(out.read_text())
    for dtype in ("float32", "bfloat16"):
        result = report[dtype]
        assert result["differ"] == [], (dtype, result["differ"][:5])
        assert result["lora"] and result["trained"] == result["lora"]
        assert 0.45 < result["read"] < 0.55 and 0.45 < result["held"] < 0.55, result


HEAP_JOB = """
import sys, torch
from unitgraph.backends.diffusion.train.engines import return_freed_weights
def rss(): return int(open("/proc/self/statm").read().split()[1]) * 4096
if sys.argv[1] == "fixed":
    assert return_freed_weights()
kept, given_back = [], []
for _ in range(8):
    whole = torch.ones(2048, 2048)  # 16 MiB, as a gathered or loaded weight
    kept.append(whole[:1024].clone())  # its half, as a process's partition
    before = rss()
    del whole
    given_back.append((before - rss()) / 2**24)
print(min(given_back[1:]))
"""


def test_a_sharded_engines_process_gives_freed_weights_back(tmp_path):
    """Whole weights made and freed one after another, keeping half of each (loading into partitions, gathering a
    layer): once the engines fix glibc's mmap threshold, each freed weight goes back to the system at once; by glibc's
    default only the first does (glibc then raises its threshold, so the later ones come from the heap and stay with
    the process: the growth that ran a 24 GiB machine out of memory under ZeRO-3). Measured per free, not as the
    process's final size, which depends on how the heap happens to fragment."""
    if not Path("/proc/self/statm").exists():
        pytest.skip("reads /proc")
    job = tmp_path / "heap.py"
    job.write_text(HEAP_JOB)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for name in [n for n in env if n.startswith(("MALLOC_", "GLIBC_TUNABLES"))]:
        env.pop(name)
    back = {mode: float(subprocess.run([sys.executable, str(job), mode], capture_output=True, text=True, env=env,
                                       check=True).stdout.strip()) for mode in ("fixed", "default")}
    assert back["fixed"] > 0.95 and back["default"] < 0.05, back
