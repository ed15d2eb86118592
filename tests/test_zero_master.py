"""DeepSpeed's ZeRO optimizer stepping the fp32 weights' own partition instead of a master copy of it
(train/engines.share_fp32_master), on 2 CPU processes.

What matters: the same trained weights to the bit as DeepSpeed's own copying way under ZeRO-1, -2 and -3, with the
copy's bytes given back (a third of weights, master and AdamW's moments; the engines benchmark's ZeRO-3 full
training held 0.67x data parallel's bytes with the copy), and held_bytes not counting the shared bytes twice.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("deepspeed")

JOB = Path(__file__).with_name("zero_master_job.py")
PARAMS = 16 * 32 + 32 + 32 * 4 + 4  # the job's model


def test_zero_steps_the_weights_partition_itself_with_the_same_results(tmp_path):
    out = tmp_path / "report.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ACCELERATE_", "FSDP_"))}
    env.update(OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu")
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           str(JOB), str(out)], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(out.read_text())
    for stage, ways in report.items():
        copied, shared = ways["copied"], ways["shared"]
        assert shared["weights"] == copied["weights"], stage  # bit for bit: lists of the same floats
        assert copied["moved"] and shared["moved"], stage  # the steps trained the weights
        assert copied["given_back"] == 0 and shared["given_back"] > 0, stage
        # this process's partition: half of the parameters (ZeRO pads them to a multiple of the processes)
        assert PARAMS * 4 / 2 <= shared["given_back"] <= PARAMS * 4 / 2 + 64, (stage, shared["given_back"])
        # held_bytes: the shared master is the weights' bytes, not state; the two moments stay
        assert copied["state"] - shared["state"] == shared["given_back"], (stage, copied["state"], shared["state"])
