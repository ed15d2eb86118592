"""benchmarks/split_vs_unsplit.py and split_vs_unsplit_report.py: its report from made-up results, and one tiny real run (1 repeat, test size)."""

from __future__ import annotations

import importlib.util
import json
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _bench():
    path = ROOT / "benchmarks" / "split_vs_unsplit.py"
    spec = importlib.util.spec_from_file_location("split_vs_unsplit", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("split_vs_unsplit", module)
    spec.loader.exec_module(module)
    return module


def _report():
    """benchmarks/split_vs_unsplit_report.py, the rendering (it imports its parameters from the module _bench registers)."""
    path = ROOT / "benchmarks" / "split_vs_unsplit_report.py"
    spec = importlib.util.spec_from_file_location("split_vs_unsplit_report", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


bench = _bench()
report = _report()
PLANNER = "<!-- planner-scaling:begin -->\n| planner table |\n<!-- planner-scaling:end -->"


def _fake_results() -> dict:
    def run(step, rss, **extra):
        return {"step_s": step, "rss": rss, "wall_s": 1.0, **extra}

    runs = {
        "stage1": [{"per_sample_s": 0.03, "total_s": 1.0, "rss": 450e6}],
        "unsplit": [run(0.040, 460e6)],
        "train": [run(0.011, 404e6, paired_limit_s=0.010, paired_ratio=1.10)],
        "loader": [run(0.0104, 404e6, paired_limit_s=0.010, paired_ratio=1.04, thread_step_s=0.012, thread_paired_ratio=1.2,
                       samples_per_s={"1": 90.0, "4": 250.0, "8": 380.0})],
        "limit": [run(0.010, 403e6, cache_dtype={d: {"tensor_bytes": 9000.0 if d == "float32" else 4600.0,
                                                      "loss_rel_median": 0.0 if d == "float32" else 1e-5,
                                                      "loss_rel_max": 0.0 if d == "float32" else 4e-5}
                                                  for d in bench.CACHE_DTYPES})],
    }
    return {
        "settings": {"sizes": {"test": bench.SIZES["test"]}, "threads": 1},
        "sizes": {"test": {"description": "tiny", "runs": runs,
                           "cache": {"file": 10000, "header": 700, "per_key": {"latent_mean": 4096, "prompt_emb": 900}, "entries": 16},
                           "model_bytes": {"dit": 1_000_000, "vae": 5_000_000, "text_encoder": 10_000_000}}},
        "planner_startup_s": [0.31, 0.30, 0.33], "total_s": 60.0, "environment": {"python": "3", "cpus": 2, "versions": {}},
    }


def test_report_ratios_table_plot_and_doc_section(tmp_path):
    summary = bench.summarize(_fake_results())
    row = summary["rows"][0]
    assert row["train_vs_limit"] == pytest.approx(1.10) and row["loader_vs_limit"] == pytest.approx(1.04)
    assert row["train_vs_unsplit"] == pytest.approx(0.011 / 0.040)
    assert row["rss_train_vs_limit"] == pytest.approx(404 / 403)
    assert row["break_even_loader"] == pytest.approx(0.03 / (0.040 - 0.0104))
    assert summary["planner_startup_s"] == pytest.approx(0.31)
    text = report.markdown(summary, "benchmark_split_vs_unsplit.png")
    assert "| test | 64 px | 40.0 |" in text and "1.040 ✓" in text and "1.100 ✗" in text
    assert "0.31 s" in text and "img/benchmark_split_vs_unsplit.png" in text
    png = report.plot(summary, tmp_path / "plot.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    doc = tmp_path / "benchmarks.md"
    doc.write_text(f"# Benchmarks\n\n## Planner scaling\n\n{PLANNER}\n")
    report.write_doc(text, doc)
    report.write_doc(text.replace("40.0", "41.0"), doc)  # replaced in place, not appended twice
    content = doc.read_text()
    assert PLANNER in content and content.count(report.BEGIN) == 1 and "| test | 64 px | 41.0 |" in content
    assert content.index("Planner scaling") < content.index(report.TITLE)


@pytest.mark.slow
def test_one_tiny_real_run(tmp_path, monkeypatch):
    torch = pytest.importorskip("torch")
    pytest.importorskip("diffusers")
    # the models are made by a child process as the benchmark makes them; the measured configurations run in this
    # process (their code is the children's own: a child process would spend most of its time importing torch)
    spawned = bench.spawn

    def in_process(config, workdir, size, rep=0):
        if config == "prepare":
            return spawned(config, workdir, size, rep)
        out, threads, start = Path(workdir) / f"result-{config}-{size}-{rep}.json", torch.get_num_threads(), time.time()
        try:
            bench.child_main(config, Path(workdir), size, out, rep)
        finally:
            torch.set_num_threads(threads)
        return {**json.loads(out.read_text()), "wall_s": time.time() - start, "maxrss_wait4": 0}

    monkeypatch.setattr(bench, "spawn", in_process)
    # what the children change for their own process, put back after the test
    from unitgraph.backends.diffusion import stages
    from unitgraph.backends.diffusion.cache import cache

    monkeypatch.setattr(stages, "KEEP_IN_MEMORY_BYTES", stages.KEEP_IN_MEMORY_BYTES)
    monkeypatch.setattr(cache.Cache, "store_entry", cache.Cache.store_entry)
    settings = {"sizes": {"test": dict(bench.SIZES["test"], samples=4, unsplit_repeat=1, train_repeat=2, sweep_steps=[2, 1, 1])},
                "threads": 1}
    results = bench.measure(["test"], 1, tmp_path / "work", settings=settings, planner_repeats=1, echo=lambda _t: None)
    summary = bench.summarize(results)
    row = summary["rows"][0]
    for key in ("t_unsplit", "t_train", "t_loader", "t_limit", "t_stage1", "train_vs_limit", "loader_vs_limit"):
        assert row[key] is not None and row[key] > 0, key
    for config in bench.CONFIGS:
        assert row[f"rss_{config}"] > 100 * 2**20, config
    assert all(row["samples_per_s"][str(b)] for b in bench.BATCH_SIZES)
    assert row["cache"]["entries"] == 4 and row["cache"]["per_key"]["input_latents"] > 0
    dtypes = row["cache_dtype"]
    assert dtypes["float32"]["loss_rel_max"] == 0.0
    assert dtypes["bfloat16"]["tensor_bytes"] < dtypes["float32"]["tensor_bytes"]
    assert "| test |" in report.markdown(summary)


def test_each_pipeline_has_its_own_section(tmp_path):
    """--pipeline flux writes a section (and plot) of its own beside Qwen-Image's, replaced in place on re-runs."""
    results = _fake_results()
    results["settings"]["pipeline"] = "flux"
    summary = bench.summarize(results)
    assert summary["pipeline"] == "flux" and summary["title"] == "FLUX.1"
    text = report.markdown(summary)
    assert "default FLUX.1 targets" in text and "--pipeline flux --write" in text and "diffusion:flux" in text
    doc = tmp_path / "benchmarks.md"
    report.write_doc(report.markdown(bench.summarize(_fake_results())), doc)
    report.write_doc(text, doc, pipeline="flux")
    report.write_doc(text.replace("40.0", "41.0"), doc, pipeline="flux")
    begin, end, title, plot = report.section_names("flux")
    content = doc.read_text()
    assert content.count(begin) == 1 and content.count(report.BEGIN) == 1 and title in content
    assert "| test | 64 px | 41.0 |" in content.split(begin)[1] and "| test | 64 px | 40.0 |" in content.split(begin)[0]
    assert plot.name == "benchmark_split_vs_unsplit_flux.png" and report.section_names("qwen_image")[3] == report.PLOT


def _module(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_run_all_names_every_benchmark_and_refuses_unknown_ones(capsys):
    run_all = _module("run_all")
    scripts = {c[0] for c in run_all.COMMANDS.values()}
    assert scripts == {f"benchmarks/{p.name}" for p in (ROOT / "benchmarks").glob("*.py")
                       if p.name not in ("run_all.py", "docsection.py", "split_vs_unsplit_report.py",
                                         "gpu_real_size.py")}  # needs a GPU: run by hand where one is lent
    text = run_all.summary("2026-12-01 10:00", "2026-12-01 11:00", {"planner": 120.0, "flux": 300.0}, ["flux"])
    assert "| `python benchmarks/planner_scaling.py --write` | 2.0 |" in text and "earlier run): flux." in text
    with pytest.raises(SystemExit):
        run_all.main(["--only", "planner,nope"])
    assert "unknown benchmark(s): nope" in capsys.readouterr().err


def test_stage1_timing_leaves_out_model_loading_inside_compute_entries(monkeypatch):
    """stage1_batching.timed_stage1 counts compute_entries' own time, not a load of the encoders inside it."""
    import time

    stage1_batching = _module("stage1_batching")
    from unitgraph.backends.diffusion import stage1, stages

    monkeypatch.setattr(stage1, "load_models", lambda *a, **k: time.sleep(0.3))

    def compute(*a, **k):
        stage1.load_models()
        time.sleep(0.05)

    monkeypatch.setattr(stage1, "compute_entries", compute)

    def run(args, echo):
        stage1.load_models()  # a load outside compute_entries is not counted either
        stage1.compute_entries()
        return type("R", (), {"samples": 4})()

    monkeypatch.setattr(stages, "run", run)
    seconds, samples, phases = stage1_batching.timed_stage1(None)
    assert samples == 4 and 0.04 < seconds < 0.2
    assert set(phases) == set(stage1_batching.PHASES) and all(v == 0.0 for v in phases.values())


def test_stage1_report_judges_the_paired_ratio_not_the_ratio_of_medians(monkeypatch, tmp_path):
    """Each round's stage 1 is divided by the limit measured right after it; the table shows the median of
    those ratios. Here the paired ratios are 1.0, 1.0 and 0.5 (median 1.0), while the ratio of the two
    medians (20 / 30) would say 0.67."""
    stage1_batching = _module("stage1_batching")
    # per round (a warm-up, then 3), the same rate at every B; round 3 is a slow moment for the limit alone
    rates = {"b": iter([10.0] * 3 + [10.0] * 3 + [30.0] * 3 + [20.0] * 3),
             "limit": iter([10.0] * 3 + [10.0] * 3 + [30.0] * 3 + [40.0] * 3)}
    def timed_stage1(args):  # model calls take 0.6 of stage 1, writes 0.2, decoding 0.1, the rest 0.1
        seconds = 1.0 / next(rates["b"])
        return seconds, 1, {"model": 0.6 * seconds, "free": 0.0, "decode": 0.1 * seconds, "write": 0.2 * seconds}

    monkeypatch.setattr(stage1_batching, "timed_stage1", timed_stage1)
    def limit(args, batch):  # decoding takes half the model calls' time
        seconds = 1.0 / next(rates["limit"])
        return seconds, 1, seconds / 2

    monkeypatch.setattr(stage1_batching, "limit", limit)
    monkeypatch.setattr(stage1_batching, "_args", lambda *a: None)
    monkeypatch.setattr(stage1_batching, "entry_distance", lambda a, b: 0.0)

    class Family:
        name = "fam"
        pipelines = [type("P", (), {"name": "p", "video_params": (), "required": ()})()]

        @staticmethod
        def tiny_module():
            return type("T", (), {"write_tiny_models": staticmethod(lambda *a, **k: tmp_path)})()

    from unitgraph.backends.diffusion import registry
    from unitgraph.backends.diffusion.data import dataset as data

    monkeypatch.setattr(registry, "families", lambda: [Family])
    monkeypatch.setattr(data, "write_synthetic_dataset", lambda *a, **k: None)
    (row,) = stage1_batching.measure("test", 1, 3, tmp_path)
    assert all(row[f"ratio{b}"] == 1.0 for b in stage1_batching.BATCHES)
    assert row["b1"] / row["limit1"] == pytest.approx(2 / 3)
    # against the calls plus decoding, each round's ratio is 1.5x: 1.5, 1.5, 0.75 (median 1.5)
    assert row["decoded1"] == pytest.approx(1.5) and row["decode_share4"] == pytest.approx(0.5)
    assert row["rest_ms1"] == pytest.approx(0.1 * 1e3 / 20.0)  # the median round: 1/20 s a sample
    assert row["model_vs_limit1"] == pytest.approx(0.6)  # 0.6 of stage 1, whose rate equals the limit's
    assert "(1.00; 1.50)" in stage1_batching.report([row], "test", 3) and "| 50% |" in stage1_batching.report([row], "test", 3)


def test_planner_scaling_measures_the_floor_pass_beside_the_planner():
    """Each row carries the bare pass's time, its growth is a column, and the summary names both."""
    planner = _module("planner_scaling")
    rows = planner.measure([100, 1000], 1, ["chain"], [])
    assert all(r["floor_s"] > 0 and r["checks"] for r in rows)
    text = planner.table(rows)
    assert "floor pass growth" in text.splitlines()[0]
    factor = planner.growth(rows, "floor_s")[("chain", "latest", 1000)]
    assert f"{factor:.1f}x" in text
    # the call count: deterministic, and linear for the chain (10x the units, about 10x the calls)
    assert "calls growth" in text.splitlines()[0]
    assert 9.0 < planner.growth(rows, "calls")[("chain", "latest", 1000)] < 11.0


def test_planner_call_count_counts_python_and_c_calls():
    planner = _module("planner_scaling")

    def work():
        for i in range(10):
            len([i])  # one C call each
    assert planner.count_calls(work) == 1 + 10
    assert planner.count_calls(lambda: None) == 1


def test_step_times_are_window_means_so_a_run_of_data_work_is_counted():
    """With batches prepared SYNC_RUN at a time, one step in each run is heavy: the median of single steps
    would drop that work, the median of window means keeps it (the first window, set-up, left out)."""
    bench = _bench()
    run = [5.0, 1.0, 1.0, 1.0]
    times = [50.0, 1.0, 1.0, 1.0] + run * 3
    assert bench.step_median(times, window=4) == pytest.approx(2.0)
    assert bench.step_median([9.0, 1.0, 2.0, 3.0], window=4) == 2.0  # too few for windows: median of the rest
    assert bench.step_median(times) == bench.step_median(times, window=bench.SYNC_RUN)


def test_thread_overlap_calibrates_its_job_and_reports_the_hidden_share():
    """The stand-in job lasts about what it is asked for; the report carries every configuration and the share."""
    import time

    bench = _module("thread_overlap")
    job = bench.python_job(2000)
    start = time.perf_counter()
    job()
    assert 0.0005 < time.perf_counter() - start < 0.05
    result = bench.measure(layers=2, job_us=50, repeats=3)
    assert all(result[k] > 0 for k in ("alone", "busy", "job", "serial", "job_only"))
    assert result["overlap"] == pytest.approx((result["serial"] - result["job"]) / result["job_only"])
    text = bench.report(result)
    assert f"{result['overlap']:.0%} |" in text and "2 linear layers" in text


def test_memory_plan_table_at_test_size(tmp_path):
    """benchmarks/memory_plan_table.py on the test-size Qwen-Image models: two dry-run plans and one measured step,
    rendered, and its section written into a doc (replaced in place on a second write)."""
    pytest.importorskip("torch")
    pytest.importorskip("diffusers")
    bench = _module("memory_plan_table")
    result = bench.measure("test", tmp_path / "work", echo=lambda _t: None, only=("qwen_image",),
                           precisions=("bf16", "bf16 + fp8 DiT + checkpointing"))
    plans = result["peaks"]["families"]["qwen_image"]
    assert set(plans) == {"bf16", "bf16 + fp8 DiT + checkpointing"}
    assert plans["bf16 + fp8 DiT + checkpointing"]["stages"]["train"]["peak_bytes"] < plans["bf16"]["stages"]["train"]["peak_bytes"]
    text = bench.report(result, "test")
    assert "| Qwen-Image, 1024x1024 | bf16 |" in text and "at test size" in text
    if bench.heap_reader() is not None:
        (row,) = result["errors"]
        assert row["step"]["estimate"] > 0 and "| qwen_image | bf16 | DiT LoRA step |" in text
    doc = tmp_path / "benchmarks.md"
    doc.write_text(f"# Benchmarks\n\n## Planner scaling\n\n{PLANNER}\n")
    bench.write_section(doc, bench.BEGIN, bench.END, bench.TITLE, text)
    bench.write_section(doc, bench.BEGIN, bench.END, bench.TITLE, text.replace("bf16", "bf17"))
    content = doc.read_text()
    assert content.count(bench.BEGIN) == 1 and PLANNER in content and "bf17" in content


def test_the_recipe_benchmark_reports_each_configuration_against_plain():
    """benchmarks/recipe.py's section from made-up step times: one row per configuration, its ratio to the plain
    step, and the ones above the noise named with why."""
    path = ROOT / "benchmarks" / "recipe.py"
    spec = importlib.util.spec_from_file_location("recipe_benchmark", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    steps = {"plain": [0.2, 0.22], "--masked_loss": [0.21, 0.21], "--lora_type dora --use_rslora": [0.33, 0.31]}
    text = module.render(steps, 2, "2026-01-01 00:00", "2026-01-01 00:05")
    assert "| plain | 210.0 ms | 1.00 |" in text and "| `--masked_loss` | 210.0 ms | 1.00 |" in text
    assert "| `--lora_type dora --use_rslora` | 320.0 ms | 1.52 |" in text
    assert "noise of about 10% of the plain step: `--masked_loss`." in text
    assert "Above it: `--lora_type dora --use_rslora` (each step takes the norm" in text
    assert all(module.available(flags) for _, flags in module.CONFIGS.values() if "optimizer" not in flags)


def test_the_datasets_benchmark_reports_reuse_and_the_held_out_cost():
    """benchmarks/datasets.py's section from made-up figures: stage 1's rows against a new cache, stage 2's whole
    runs against the run without held-out entries, and one evaluation's cost as the difference over the evaluations."""
    path = ROOT / "benchmarks" / "datasets.py"
    spec = importlib.util.spec_from_file_location("datasets_benchmark", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    stage1 = dict(zip(module.STAGE1, ([(5.0, 8, 8), (5.2, 8, 8)], [(10.0, 16, 0), (10.4, 16, 0)],
                                       [(1.0, 0, 16), (1.0, 0, 16)])))
    stage2 = dict(zip(module.STAGE2, ([(20.0, 0.2, 0), (20.0, 0.2, 0)], [(22.0, 0.2, 4), (22.0, 0.2, 4)])))
    text = module.render({"stage1": stage1, "stage2": stage2}, 2, "2026-01-01 00:00", "2026-01-01 00:05")
    assert "| a, then a + b (b added) | 8 | 8 | 5.10 s | 0.50 |" in text
    assert "| a + b into a new cache | 16 | 0 | 10.20 s | 1.00 |" in text
    assert "| a + b again (nothing changed) | 0 | 16 | 1.00 s | 0.10 |" in text
    assert "| held-out loss every 8 steps | 22.00 s | 1.10 | 200.0 ms | 4 |" in text
    assert "One evaluation of the 4 held-out samples took about 0.50 s (2.5 training steps' time" in text
