"""The report of benchmarks/split_vs_unsplit.py: its section of docs/benchmarks.md (tables and prose) and its plot.

markdown() renders a summary (split_vs_unsplit.summarize of one run's results) as the section's text, plot()
draws the figure beside it and write_doc() replaces the pipeline's section of docs/benchmarks.md; section_names()
gives each pipeline's markers, title and plot path. The measuring parameters the prose states come from
split_vs_unsplit, which imports this module only in its main().
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Optional

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
from docsection import write_section  # noqa: E402
from split_vs_unsplit import BATCH_SIZES, CHUNK, DEFAULT_PIPELINE, LOADER_CHUNKS, ROUNDED, SIZES, SYNC_RUN  # noqa: E402

DOC = ROOT / "docs" / "benchmarks.md"
PLOT = ROOT / "docs" / "img" / "benchmark_split_vs_unsplit.png"
BEGIN, END = "<!-- split-vs-unsplit:begin -->", "<!-- split-vs-unsplit:end -->"
TITLE = "## Split vs unsplit training (Qwen-Image-shaped tiny models)"


def section_names(pipeline: str) -> tuple[str, str, str, Path]:
    """(begin marker, end marker, title, plot path) of a pipeline's section of docs/benchmarks.md."""
    if pipeline == DEFAULT_PIPELINE:
        return BEGIN, END, TITLE, PLOT
    from unitgraph.backends.diffusion.registry import find_pipeline

    family, _ = find_pipeline(pipeline)
    return (f"<!-- split-vs-unsplit:{pipeline}:begin -->", f"<!-- split-vs-unsplit:{pipeline}:end -->",
            f"## Split vs unsplit training ({family.title}-shaped tiny models, `{pipeline}`)",
            PLOT.with_name(f"benchmark_split_vs_unsplit_{pipeline}.png"))


def _ms(seconds: Optional[float]) -> str:
    return "–" if seconds is None else f"{1000 * seconds:.1f}"


def _x(value: Optional[float], digits: int = 2) -> str:
    return "–" if value is None else f"{value:.{digits}f}"


def _mb(value: Optional[float]) -> str:
    return "–" if value is None else f"{value / 2**20:.0f}"


def _kb(value: Optional[float]) -> str:
    return "–" if value is None else f"{value / 1024:.1f}"


def _mark(value: Optional[float], target: float) -> str:
    if value is None:
        return "–"
    return f"{value:.3f} {'✓' if value <= target else '✗'}"


def markdown(summary: dict[str, Any], plot_name: Optional[str] = None) -> str:
    rows = summary["rows"]
    out = []
    threads = summary.get("threads")
    out.append(f"Step times in ms: per process, the median over windows of {SYNC_RUN} consecutive steps of each window's "
               "mean (the first window left out: with batches prepared that many at a time, each window holds one "
               "run of the data work), then the median over repeats. "
               "`train` is `sft:train` through `stages.run` (whose stage 2 takes its batches from "
               "`backends/diffusion/train/executor.py`), every cache entry read from disk and parsed at its step (its checksum "
               "checked on its first read); "
               "`loader` is the same data path in a bare loop of the benchmark's own, the batches read and their "
               f"model-free train units run in the loop when asked for, {SYNC_RUN} at a time (the CPU default); "
               "`thread` prepares up to two batches "
               "ahead in a background thread instead; `limit` is the same denoiser step (LoRA forward, backward, AdamW) "
               "on sink inputs already in memory, in a process of its own. The ratios to the limit are paired: each "
               "`train` process runs the same steps from memory right after `stages.run` (at `test` size, where a whole run "
               f"lasts about half a second, a warm-up run and then {SIZES['test']['train_rounds']} runs between in-memory "
               "passes, L T L T ... L, each run divided by the mean of the passes on either side of it, the median of "
               "those), each `loader` process "
               f"alternates its modes and the in-memory steps every {CHUNK} steps, at least {LOADER_CHUNKS} chunks of "
               "each after an untimed warm-up of every mode (each chunk timed whole: the mean of its steps); the "
               "table gives the median of the per-process ratios. "
               + (f"torch uses {threads} intra-op thread{'s' if threads != 1 else ''} in every configuration "
                  "(on this shared 2-core machine two threads slow down 5-10x whenever another process runs). " if threads else "")
               + "\n")
    out.append("| size | image | t_unsplit | t_stage1 / sample | t_train | t_train (loader) | t_limit | "
               "train / limit (≤ 1.05) | loader / limit (≤ 1.05) | thread / limit | train / unsplit | loader / unsplit | break-even epochs |")
    out.append("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        be = r["break_even_loader"] if r["break_even_loader"] is not None else r["break_even_train"]
        image = f"{r['px']} px" + (f" x {r['frames']} frames" if r.get("frames") else "")
        out.append(f"| {r['size']} | {image} | {_ms(r['t_unsplit'])} | {_ms(r['t_stage1'])} | {_ms(r['t_train'])} | "
                   f"{_ms(r['t_loader'])} | {_ms(r['t_limit'])} | {_mark(r['train_vs_limit'], 1.05)} | "
                   f"{_mark(r['loader_vs_limit'], 1.05)} | {_x(r.get('thread_vs_limit'), 3)} | {_x(r['train_vs_unsplit'])} | "
                   f"{_x(r['loader_vs_unsplit'])} | {_x(be)} |")
    out.append("")
    met = [r for r in rows if r["loader_vs_limit"] is not None and r["loader_vs_limit"] <= 1.05]
    missed = [r for r in rows if r["loader_vs_limit"] is not None and r["loader_vs_limit"] > 1.05]
    findings = []
    if met:
        findings.append("Stage 2 through the loader is within 5% of the bare denoiser step at size "
                        + ", ".join(f"`{r['size']}` ({r['loader_vs_limit']:.3f})" for r in met) + ".")
    for r in missed:
        over = r.get("loader_overhead_s")
        findings.append(
            f"At `{r['size']}` the denoiser step takes only {_ms(r['t_limit'])} ms and the work around it "
            f"({'' if over is None else f'{1000 * over:.2f} ms: '}reading the entry, the four model-free train units that "
            "draw each sample's latent, noise and timestep, the loop's own bookkeeping) is CPU time that a CPU-only "
            "machine cannot hide: running it ahead in a thread costs the same CPU time plus GIL hand-offs (the "
            "`thread / limit` column; torch's CPU backward needs the GIL between its kernels, see the section on a "
            "batch prepared during backward). Right after a denoiser step that Python work also runs from cold CPU caches, "
            f"several times slower than in a tight loop, which is why the loop prepares {SYNC_RUN} batches at a time "
            "(the later ones find the caches warm). The seeded dropout stream is already skipped when no trained "
            "model has dropout (these have none). On a GPU the host CPU is idle during the step and `iterate()` "
            "prepares batches ahead in a thread (its default there); on the CPU, `--batch_size` spreads the per-step "
            "work over several samples (the batch-size table below).")
    first = [r for r in rows if r.get("train_first_vs_limit") is not None and r["size"] in ROUNDED]
    if first:
        findings.append("The warm-up run of each process (its first `stages.run`, judged on nothing: a fresh process's "
                        "one-off set-up falls in it) gave " + ", ".join(f"`{r['size']}` {r['train_first_vs_limit']:.3f}"
                                                                        for r in first)
                        + " of the in-memory steps measured right after it.")
    if findings:
        out.append(" ".join(findings) + "\n")
    out.append("Sizes: " + "; ".join(f"`{r['size']}`: {r['description']}" for r in rows) + ". "
               f"LoRA rank 32 on DiffSynth's default {summary.get('title', 'Qwen-Image')} targets, AdamW, float32, one sample per step. "
               "Break-even epochs = t_stage1 per sample / (t_unsplit − t_train (loader)): from that many epochs on, "
               "stage 1 plus stage 2 costs less than unsplit training (process start and model loading left out).\n")
    out.append("Peak RSS in MB (VmHWM of each configuration's own process; libraries alone take most of it), and the "
               "model weights each configuration loads:\n")
    out.append("| size | unsplit | stage 1 | train | train (loader) | limit | train / unsplit | train / limit (≤ 1.10) | "
               "loader / limit (≤ 1.10) | weights unsplit | weights stage 2 |")
    out.append("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        mb = r["model_bytes"]
        out.append(f"| {r['size']} | {_mb(r['rss_unsplit'])} | {_mb(r['rss_stage1'])} | {_mb(r['rss_train'])} | "
                   f"{_mb(r['rss_loader'])} | {_mb(r['rss_limit'])} | {_x(r['rss_train_vs_unsplit'])} | "
                   f"{_mark(r['rss_train_vs_limit'], 1.10)} | {_mark(r['rss_loader_vs_limit'], 1.10)} | "
                   f"{_mb(sum(mb.values()))} | {_mb(next(iter(mb.values())))} |")  # the denoiser is first
    out.append("")
    ok = [r for r in rows if r["rss_loader_vs_limit"] is not None]
    if ok:
        worst = max(max(r["rss_loader_vs_limit"], r["rss_train_vs_limit"] or 0) for r in ok)
        saved = ", ".join(f"`{r['size']}` {_mb((r['rss_unsplit'] or 0) - (r['rss_train'] or 0))} MB" for r in ok)
        out.append(f"Stage 2 never loads the frozen encoders: its peak RSS is at most {100 * (worst - 1):.1f}% above the "
                   f"limit configuration, and below the unsplit run's by {saved}.\n")
    out.append("Batch size (stage 2 through the loader: shape buckets, per-sample randomness, one sink call per batch), "
               "samples per second:\n")
    out.append("| size | B = 1 | B = 4 | B = 8 | B = 4 vs 1 | B = 8 vs 1 |")
    out.append("|---|---:|---:|---:|---:|---:|")
    for r in rows:
        sps = r["samples_per_s"]

        def speed(b: int) -> str:
            return "–" if not sps.get(str(b)) or not sps.get("1") else f"{sps[str(b)] / sps['1']:.2f}x"

        out.append(f"| {r['size']} | {_x(sps.get('1'), 1)} | {_x(sps.get('4'), 1)} | {_x(sps.get('8'), 1)} | {speed(4)} | {speed(8)} |")
    out.append("")
    keys = sorted({k for r in rows for k in r["cache"]["per_key"]})
    out.append("Cache size per sample in KB (float32, stage 1's default; `unitgraph cache info DIR` prints the same per "
               "entry key): the whole entry file, its header (JSON values such as sizes and img_shapes), and the tensor "
               "data of each cache entry:\n")
    out.append("| size | entry file | header | " + " | ".join(keys) + " |")
    out.append("|---|---:|---:|" + "---:|" * len(keys))
    for r in rows:
        c = r["cache"]
        out.append(f"| {r['size']} | {_kb(c['file'])} | {_kb(c['header'])} | "
                   + " | ".join(_kb(c["per_key"].get(k)) if k in c["per_key"] else "–" for k in keys) + " |")
    out.append("")
    out.append("Floating cache tensors stored as bf16 / fp16 and read back as float32 (`--cache_dtype bf16|fp16`): "
               "tensor bytes per sample, and the relative change of the loss on the same samples and draws "
               "(median / max over samples):\n")
    out.append("| size | fp32 KB | bf16 KB | fp16 KB | loss change bf16 | loss change fp16 |")
    out.append("|---|---:|---:|---:|---:|---:|")
    for r in rows:
        d = r["cache_dtype"]

        def change(name: str) -> str:
            m, x = d[name]["loss_rel_median"], d[name]["loss_rel_max"]
            return "–" if m is None else f"{m:.1e} / {x:.1e}"

        out.append(f"| {r['size']} | {_kb(d['float32']['tensor_bytes'])} | {_kb(d['bfloat16']['tensor_bytes'])} | "
                   f"{_kb(d['float16']['tensor_bytes'])} | {change('bfloat16')} | {change('float16')} |")
    out.append("")
    if summary.get("planner_startup_s") is not None:
        out.append(f"Planner start-up: `unitgraph plan diffusion:{summary.get('pipeline', DEFAULT_PIPELINE)} --lora-base-model dit` as a whole process "
                   f"(interpreter start, imports, plan, verification, writing the plan): "
                   f"**{summary['planner_startup_s']:.2f} s** (median of {summary['planner_runs']} runs; target well under 1 s).\n")
    if plot_name:
        out.append(f"![step time and peak RSS per configuration](img/{plot_name})\n")
    env = summary.get("environment", {})
    versions = ", ".join(f"{k} {v}" for k, v in (env.get("versions") or {}).items() if v)
    total = summary.get("total_s")
    flag = "" if summary.get("pipeline", DEFAULT_PIPELINE) == DEFAULT_PIPELINE else f" --pipeline {summary['pipeline']}"
    out.append(f"One run of `python benchmarks/split_vs_unsplit.py{flag} --write` ({summary['repeats']} repeats, configurations "
               f"alternating, each in its own process{'' if total is None else f'; {total / 60:.1f} min in all'}) on "
               f"{env.get('cpus', '?')} CPU cores, Python {env.get('python', '?')}, {versions}. "
               "The machine is shared: single steps occasionally take several times longer, which the medians absorb.")
    return "\n".join(out)


def plot(summary: dict[str, Any], path: Path) -> Path:
    import io

    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    rows = summary["rows"]
    colour = {"unsplit": "tab:blue", "stage 1": "tab:gray", "train": "tab:orange", "train (loader)": "tab:green",
              "limit": "tab:red"}
    fig = Figure(figsize=(12, 4), dpi=100)
    configs = [("t_unsplit", "unsplit"), ("t_train", "train"), ("t_loader", "train (loader)"), ("t_limit", "limit")]
    ax = fig.add_subplot(1, 3, 1)
    width = 0.8 / len(configs)
    for k, (key, label) in enumerate(configs):
        ax.bar([i + k * width for i in range(len(rows))], [1000 * (r[key] or 0) for r in rows], width, label=label,
               color=colour[label])
    ax.set_xticks([i + width * (len(configs) - 1) / 2 for i in range(len(rows))], [r["size"] for r in rows])
    ax.set_yscale("log")
    ax.set_ylabel("ms per step (log)")
    ax.set_title("step time")
    ax.legend(fontsize=8)
    ax = fig.add_subplot(1, 3, 2)
    rss = [("rss_unsplit", "unsplit"), ("rss_stage1", "stage 1"), ("rss_train", "train"), ("rss_loader", "train (loader)"),
           ("rss_limit", "limit")]
    width = 0.8 / len(rss)
    for k, (key, label) in enumerate(rss):
        ax.bar([i + k * width for i in range(len(rows))], [(r[key] or 0) / 2**20 for r in rows], width, label=label,
               color=colour[label])
    ax.set_xticks([i + width * (len(rss) - 1) / 2 for i in range(len(rows))], [r["size"] for r in rows])
    ax.set_ylabel("MB")
    ax.set_title("peak RSS")
    ax.legend(fontsize=8)
    ax = fig.add_subplot(1, 3, 3)
    for r in rows:
        sps = r["samples_per_s"]
        if sps.get("1"):
            ax.plot(BATCH_SIZES, [(sps.get(str(b)) or float("nan")) / sps["1"] for b in BATCH_SIZES], marker="o", label=r["size"])
    ax.set_xticks(BATCH_SIZES)
    ax.set_xlabel("batch size")
    ax.set_ylabel("samples/s relative to B = 1")
    ax.set_title("stage 2 batch size")
    ax.legend(fontsize=8)
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(buffer.getvalue())
    return path


def write_doc(text: str, doc: Path = DOC, pipeline: str = DEFAULT_PIPELINE) -> None:
    begin, end, title, _ = section_names(pipeline)
    write_section(doc, begin, end, title, text)
