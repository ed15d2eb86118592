"""A bucket deleted while stage 1 fills it: one line naming the location, never a traceback (docs/safety.md)."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from clitools import cli, one_error_line  # noqa: E402
from unitgraph.backends.diffusion.data.dataset import write_synthetic_dataset  # noqa: E402


@pytest.mark.slow
def test_a_bucket_deleted_during_stage1_is_one_line(s3, tiny, tmp_path, capsys, monkeypatch):
    from unitgraph.backends.diffusion import stage1

    data = tmp_path / "data"
    write_synthetic_dataset(data, count=6, size=32, seed=0)
    real = stage1.run_unit
    calls = {"n": 0}

    def deleting(*a, **k):
        calls["n"] += 1
        if calls["n"] == 8:  # a few entries in: the bucket goes away
            s3.reset()  # every bucket and object gone, as a deleted bucket is
        return real(*a, **k)

    monkeypatch.setattr(stage1, "run_unit", deleting)
    code, _, err = cli(capsys, "train", "--task", "sft:data_process", "--model_paths", str(tiny),
                       "--dataset_base_path", str(data), "--dataset_metadata_path", str(data / "metadata.csv"),
                       "--lora_base_model", "dit", "--max_pixels", "1024", "--output_path", "s3://cache/run",
                       "--no-progress")
    one_error_line(code, err, "s3://cache")
