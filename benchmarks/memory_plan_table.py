"""The memory plan (`unitgraph train --dry_run`) of the released models, and how far it is from a measured step.

Two parts, both in docs/memory.md and docs/benchmarks.md:

- **Peaks.** The dry run's stage-2 and unsplit peaks of Qwen-Image at 1024x1024, FLUX.1-dev at 1024x1024 and
  Wan 2.1 T2V 14B at 832x480 x 81 frames, a LoRA of rank 32 on the DiT (the family's default targets), batch 1, at
  fp32; bf16; bf16 with the DiT stored in fp8; and that with gradient checkpointing; then Qwen-Image beside
  musubi-tuner's published figures (docs/qwen_image.md there: 1024x1024, batch 1, bf16, checkpointing: 42 GB,
  30 GB with fp8, 24 GB with 16 blocks swapped, 12 GB with 45). Each plan is made from config-only folders
  (`tiny-models --size real`): nothing is downloaded, no weight exists.
- **Error.** At demo size (tiny random-weight models, real weights), one training step is run on this CPU through
  the run's own code (`load_models`, `prepare_models`, the pipeline's loss, its backward) and measured twice: the
  bytes of the storages it creates, logged by the same tracker on real tensors, and the heap in use (glibc's
  mallinfo2, in-use plus mmapped bytes, sampled after every op, above the value before the step; the step after
  a first, warm-up step). The same for each stage-1 encoder's forward. Beside each: the estimate.

    python benchmarks/memory_plan_table.py [--size real|test] [--no-measure] [--write]

`--size test` runs the same code on the tiny test-size models (seconds; the suite's smoke test).
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
from docsection import installed_versions, write_section  # noqa: E402

DOC = ROOT / "docs" / "benchmarks.md"
MEMORY_DOC = ROOT / "docs" / "memory.md"
BEGIN, END = "<!-- memory-plan:begin -->", "<!-- memory-plan:end -->"
TITLE = "## The memory plan (`--dry_run`) of the released models, and its measured error"
GIB = 1 << 30

# row -> (pipeline, size flags at real size, size flags at test size, what it is); a row is a family's first pipeline
# or, where a family holds several releases (FLUX.2's klein and dev), one of its pipelines
MODELS = {
    "qwen_image": ("qwen_image", {"height": 1024, "width": 1024}, {"height": 64, "width": 64}, "Qwen-Image, 1024x1024"),
    "flux": ("flux", {"height": 1024, "width": 1024}, {"height": 64, "width": 64}, "FLUX.1-dev, 1024x1024"),
    "wan": ("wan", {"height": 480, "width": 832, "num_frames": 81}, {"height": 32, "width": 32, "num_frames": 5},
            "Wan 2.1 T2V 14B, 832x480 x 81 frames"),
    "sd15": ("sd15", {"height": 512, "width": 512}, {"height": 64, "width": 64}, "Stable Diffusion 1.5, 512x512"),
    "sdxl": ("sdxl", {"height": 1024, "width": 1024}, {"height": 64, "width": 64}, "SDXL base 1.0, 1024x1024"),
    "z_image": ("z_image", {"height": 1024, "width": 1024}, {"height": 64, "width": 64}, "Z-Image, 1024x1024"),
    "flux2_klein": ("flux2_klein", {"height": 1024, "width": 1024}, {"height": 64, "width": 64},
                    "FLUX.2 [klein] 4B, 1024x1024"),
    "flux2": ("flux2", {"height": 1024, "width": 1024}, {"height": 64, "width": 64}, "FLUX.2-dev, 1024x1024"),
    "wan_a14b": ("wan", {"height": 480, "width": 832, "num_frames": 81, "expert": "low_noise"},
                 {"height": 32, "width": 32, "num_frames": 5, "expert": "low_noise"},
                 "Wan 2.2 T2V A14B (one expert), 832x480 x 81 frames"),
    "wan_ti2v": ("wan_ti2v", {"height": 704, "width": 1280, "num_frames": 121, "extra_inputs": "input_image"},
                 {"height": 32, "width": 32, "num_frames": 5, "extra_inputs": "input_image"},
                 "Wan 2.2 TI2V-5B, 1280x704 x 121 frames"),
    "ltx2": ("ltx2", {"height": 512, "width": 768, "num_frames": 121}, {"height": 32, "width": 32, "num_frames": 9},
             "LTX-2 (19B), 768x512 x 121 frames with sound"),
}
# rows whose folder is another layout of the family's: (the released configs' --size, the tiny folder's options)
FOLDERS = {"wan_a14b": ("real-a14b", {"experts": True})}
PRECISIONS = [  # (label, flags)
    ("fp32", {"mixed_precision": "no"}),
    ("bf16", {"mixed_precision": "bf16"}),
    ("bf16 + fp8 DiT", {"mixed_precision": "bf16", "fp8_models": "dit"}),
    ("bf16 + fp8 DiT + checkpointing", {"mixed_precision": "bf16", "fp8_models": "dit",
                                        "use_gradient_checkpointing": True}),
]
_FP8_CKPT = {"mixed_precision": "bf16", "fp8_models": "dit", "use_gradient_checkpointing": True}
MUSUBI = [  # (musubi-tuner's row, our flags, its published VRAM in GB)
    ("bf16, checkpointing", {"mixed_precision": "bf16", "use_gradient_checkpointing": True}, 42),
    ("`--fp8_base --fp8_scaled`", _FP8_CKPT, 30),
    ("+ `--blocks_to_swap 16`", dict(_FP8_CKPT, blocks_to_swap=16), 24),
    ("+ `--blocks_to_swap 45`", dict(_FP8_CKPT, blocks_to_swap=45), 12),
]
# musubi-tuner's Qwen-Image LoRA: every Linear of the transformer blocks but the modulation
# (networks/lora_qwen_image.py: QwenImageTransformerBlock, excluding `_mod_`)
MUSUBI_TARGETS = ("to_q,to_k,to_v,add_q_proj,add_k_proj,add_v_proj,to_out.0,to_add_out,img_mlp.net.0.proj,"
                  "img_mlp.net.2,txt_mlp.net.0.proj,txt_mlp.net.2")
ATTENTION = "to_q,to_k,to_v,to_out.0"
MEASURED = [  # (family, flags at demo size, at test size): the steps measured for the error table
    ("qwen_image", {"max_pixels": 512 * 512, "lora_target_modules": ATTENTION}, {"max_pixels": 64 * 64}),
    ("flux", {"max_pixels": 512 * 512, "lora_target_modules": ATTENTION}, {"max_pixels": 64 * 64}),
    ("wan", {"max_pixels": 256 * 256, "num_frames": 9}, {"max_pixels": 32 * 32, "num_frames": 5}),
]
MEASURED_PRECISIONS = [  # bf16 asked for: a CPU without bf16 kernels defaults to fp32 (config.default_precision)
    ("bf16", {"mixed_precision": "bf16"}),
    ("bf16 + checkpointing", {"mixed_precision": "bf16", "use_gradient_checkpointing": True}),
    ("bf16 + fp8 DiT", {"mixed_precision": "bf16", "fp8_models": "dit"}), ("fp32", {"mixed_precision": "no"})]


def gib(value: float) -> str:
    return f"{value / GIB:.2f}"


def families() -> dict[str, Any]:
    """{row of MODELS (or a family's name): its family}."""
    from unitgraph.backends.diffusion.registry import families as registered, find_pipeline

    return {**{f.name: f for f in registered()}, **{row: find_pipeline(spec[0])[0] for row, spec in MODELS.items()}}


def model_folder(family: str, size: str, work: Path) -> Path:
    """The family's folder: the released configs alone at `real`, tiny random-weight models at test or demo size."""
    folder = work / f"{family}-{size}"
    if not (folder / "model_index.json").is_file():
        fam = families()[family]
        real_size, options = FOLDERS.get(family, ("real", {}))
        if size == "real":
            import importlib

            importlib.import_module(".real", fam.package).write_real_configs(folder, real_size, pipeline=_pipeline(family))
        else:
            fam.tiny_module().write_tiny_models(folder, size=size, seed=0, pipeline=_pipeline(family), **options)
    return folder


def _pipeline(row: str) -> str:
    return MODELS[row][0] if row in MODELS else families()[row].pipelines[0].name


def plan_of(family: str, folder: Path, flags: dict[str, Any], lora_targets: Optional[str] = None) -> dict[str, Any]:
    """The memory plan of a DiT LoRA (rank 32, batch 1) on `folder` with `flags`."""
    from unitgraph.backends.diffusion.args import make_args
    from unitgraph.backends.diffusion.config import RunConfig
    from unitgraph.backends.diffusion.memory_plan import memory_plan
    from unitgraph.backends.diffusion.session import plan_for

    pipeline = MODELS[family][0]
    extra = {"lora_target_modules": lora_targets} if lora_targets else {}
    denoiser = families()[family].model_slots[0]  # "dit" in the flags below stands for it (a UNet family's "unet")
    flags = {k: (denoiser if k == "fp8_models" and v == "dit" else v) for k, v in flags.items()}
    args = make_args(pipeline=pipeline, model_paths=str(folder), dataset_base_path=str(folder),
                     lora_base_model=denoiser, lora_rank=32, batch_size=1, **extra, **flags)
    cfg = RunConfig.from_args(args)
    return memory_plan(cfg, plan_for(cfg))


def peaks(size: str, work: Path, echo: Any = print, only: Optional[tuple[str, ...]] = None,
          precisions: Optional[tuple[str, ...]] = None) -> dict[str, Any]:
    """{family: {precision label: plan}} and Qwen-Image's musubi rows, at real (or test) size (`only` some families,
    `precisions` some labels of PRECISIONS; the musubi rows only with Qwen-Image and every precision)."""
    out: dict[str, Any] = {"families": {}, "musubi": []}
    for family, (_pipeline, real_flags, test_flags, _title) in MODELS.items():
        if only and family not in only:
            continue
        folder = model_folder(family, size, work)
        size_flags = real_flags if size == "real" else test_flags
        out["families"][family] = {}
        for label, flags in PRECISIONS:
            if precisions and label not in precisions:
                continue
            start = time.perf_counter()
            out["families"][family][label] = plan_of(family, folder, {**size_flags, **flags})
            echo(f"memory_plan_table: {family} {label}: {time.perf_counter() - start:.1f} s")
    if (only and "qwen_image" not in only) or precisions:
        return out
    folder = model_folder("qwen_image", size, work)
    size_flags = MODELS["qwen_image"][1] if size == "real" else MODELS["qwen_image"][2]
    for label, flags, published in MUSUBI:
        if size != "real" and flags.get("blocks_to_swap"):
            flags = dict(flags, blocks_to_swap=1)  # the test-size DiT has 2 blocks
        plans = {name: plan_of("qwen_image", folder, {**size_flags, **flags}, targets)
                 for name, targets in (("default", None), ("musubi", MUSUBI_TARGETS if size == "real" else ATTENTION),
                                       ("attention", ATTENTION))}
        out["musubi"].append((label, published, plans))
        echo(f"memory_plan_table: qwen_image (musubi) {label}")
    return out


# ------------------------------------------------------------------------------------------------
# measuring a step


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                      "fsmblks", "uordblks", "fordblks", "keepcost")]


def heap_reader() -> Optional[Any]:
    """A function giving glibc's heap bytes in use (small blocks plus mmapped ones), or None without glibc 2.33+."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = _MallInfo2
    except (OSError, AttributeError):
        return None

    def in_use() -> int:
        info = libc.mallinfo2()
        return int(info.uordblks + info.hblkhd)

    return in_use


def _measured(heap: Any, known: list[Any], run: Any, rounds: int = 2) -> list[tuple[int, int]]:
    """(tracked storage peak, heap peak above the start) of `run()` in each round; `run` returns the tensors whose
    storages to leave out (gradients)."""
    from unitgraph.backends.diffusion.memory_trace import StorageLog

    results = []
    for _ in range(rounds):
        gc.collect()
        base = heap()
        top = [base]
        with StorageLog(known, after_op=lambda: top.__setitem__(0, max(top[0], heap()))) as log:
            leave_out = run()
        serials = log.serials_of(leave_out)
        leave_bytes = sum(t.numel() * t.element_size() for t in leave_out)
        results.append((log.peak(exclude=serials), top[0] - base - leave_bytes))
        del leave_out
    return results


def _run(family: str, folder: Path, flags: dict[str, Any]) -> Any:
    """The run's configuration and plan, the family's memory module, the configs and sizes, the compute dtype."""
    import torch

    from unitgraph.backends.diffusion.args import make_args
    from unitgraph.backends.diffusion.config import RunConfig
    from unitgraph.backends.diffusion.memory_plan import family_memory, read_configs
    from unitgraph.backends.diffusion.session import plan_for

    args = make_args(task="sft:train", pipeline=MODELS[family][0], model_paths=str(folder),
                     dataset_base_path=str(folder), lora_base_model="dit", lora_rank=8, progress=False, **flags)
    cfg = RunConfig.from_args(args)
    memory = family_memory(cfg)
    configs = read_configs(cfg, cfg.pipeline.spec().models)
    dims = memory.dims(cfg, configs, None)
    return cfg, plan_for(cfg), memory, configs, dims, getattr(torch, cfg.precision.compute_dtype)


def _measured_step(heap: Any, run: Any) -> list[tuple[int, int]]:
    """A DiT LoRA step as stage 2 takes it: its models loaded and prepared by the run's code, the loss, the backward."""
    import torch

    from unitgraph.backends.diffusion.models.stage import load_models, make_context
    from unitgraph.backends.diffusion.session import make_accelerator
    from unitgraph.backends.diffusion.train.loop import prepare_models

    cfg, plan, memory, configs, dims, dtype = run
    accelerator = make_accelerator(cfg)
    models = load_models(cfg, plan.train_models, training=True, device=accelerator.device)
    models, _optimizer, _ = prepare_models(cfg, plan, models, accelerator)
    ctx = make_context(cfg, models, accelerator.device)
    modules = [m for m in models.values() if isinstance(m, torch.nn.Module)]

    def step() -> list[Any]:
        inputs = memory.sink_inputs(cfg, dims, configs, cfg.optim.batch_size, dtype)
        loss = cfg.pipeline.loss(ctx, inputs)
        del inputs
        accelerator.backward(loss)
        del loss
        grads = [p.grad for m in modules for p in m.parameters() if p.grad is not None]
        for m in modules:
            for p in m.parameters():
                p.grad = None
        return grads

    return _measured(heap, [t for m in modules for t in (*m.parameters(), *m.buffers())], step)


def _measured_encoders(heap: Any, run: Any) -> dict[str, list[tuple[int, int]]]:
    """Each stage-1 encoder's forward, as its unit calls it, on the models stage 1 loads."""
    import torch

    from unitgraph.backends.diffusion.models.stage import load_models, make_context

    cfg, plan, memory, configs, dims, dtype = run
    encoders = load_models(cfg, plan.data_process_models, training=False, device="cpu")
    calls = memory.encoder_calls(cfg, dims, configs, 1, dtype)
    ctx = make_context(cfg, encoders, "cpu")
    out = {}
    for slot in plan.data_process_models:
        model = encoders[slot]

        def forward(model: Any = model, slot: str = slot) -> list[Any]:
            with torch.no_grad(), ctx.autocast():
                calls[slot](model)
            return []

        out[slot] = _measured(heap, [*model.parameters(), *model.buffers()], forward)
    return out


def measure_step(family: str, folder: Path, flags: dict[str, Any]) -> dict[str, Any]:
    """One DiT LoRA training step run for real (the run's own loading, preparation, loss and backward) and each
    stage-1 encoder's forward, measured, beside the plan's estimates."""
    from unitgraph.backends.diffusion.memory_plan import memory_plan

    heap = heap_reader()
    run = _run(family, folder, flags)
    estimate = memory_plan(run[0], run[1])["stages"]
    encoders = _measured_encoders(heap, run)
    return {"step": {"estimate": estimate["train"]["step_activation_bytes"], "measured": _measured_step(heap, run)},
            "encoders": {slot: {"estimate": estimate["data_process"]["models"][slot]["forward_activation_bytes"],
                                "measured": measured} for slot, measured in encoders.items()}}


def errors(size: str, work: Path, echo: Any = print, only: Optional[tuple[str, ...]] = None,
           precisions: Optional[tuple[str, ...]] = None) -> list[dict[str, Any]]:
    """The estimate against the measurement, for every family and precision of MEASURED (or `only` / `precisions`)."""
    rows = []
    for family, demo_flags, test_flags in MEASURED:
        if only and family not in only:
            continue
        folder = model_folder(family, "demo" if size == "real" else "test", work)
        for label, flags in MEASURED_PRECISIONS:
            if precisions and label not in precisions:
                continue
            start = time.perf_counter()
            result = measure_step(family, folder, {**(demo_flags if size == "real" else test_flags), **flags})
            rows.append({"family": family, "precision": label, **result})
            echo(f"memory_plan_table: measured {family} {label}: {time.perf_counter() - start:.1f} s")
    return rows


# ------------------------------------------------------------------------------------------------
# the report


def _row_error(estimate: int, measured: list[tuple[int, int]]) -> tuple[str, str, str]:
    tracked, heap = measured[-1]  # the step after the warm-up
    mib = lambda v: f"{v / 2**20:.2f}"  # noqa: E731
    error = f"{(estimate - heap) / heap:+.1%}" if heap > 0 else "-"
    return mib(tracked), mib(heap), error


def report(result: dict[str, Any], size: str) -> str:
    titles = {f: MODELS[f][3] for f in MODELS}
    lines = [
        f"Made {time.strftime('%Y-%m-%d')} with `python benchmarks/memory_plan_table.py --write` ({os.cpu_count()} CPU "
        f"cores, {platform.machine()}, Python {platform.python_version()}, "
        f"{installed_versions(('torch', 'diffusers', 'transformers', 'peft'))})"
        + (", at test size (the smoke test's figures, not the released models')" if size != "real" else "") + ".",
        "",
        "**Dry-run peaks** (GiB; LoRA rank 32 on the DiT with the family's default targets, batch 1, Adam, the "
        "longest prompt; stage 2 holds the DiT alone, the unsplit run every model):",
        "",
        "| model | precision | stage 2: weights | trainable | activations | **stage 2 peak** | **unsplit peak** |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for family, plans in result["peaks"]["families"].items():
        for label, plan in plans.items():
            train, unsplit = plan["stages"]["train"], plan["stages"]["unsplit"]
            lines.append(f"| {titles[family]} | {label} | {gib(train['weight_bytes'])} | "
                         f"{gib(train['trainable_bytes'])} | {gib(train['activation_bytes'])} | "
                         f"**{gib(train['peak_bytes'])}** | **{gib(unsplit['peak_bytes'])}** |")
    lines += [] if not result["peaks"]["musubi"] else [
        "",
        "**Qwen-Image beside musubi-tuner's figures** (1024x1024, batch 1, bf16, gradient checkpointing; musubi-tuner "
        "caches the text encoder's outputs as stage 2 does; its LoRA covers every Linear of the blocks but the "
        "modulation, its rank is not stated; GB as its table gives them). Stage 2 peaks in GiB, LoRA rank 32 on: the "
        "family's default targets (DiffSynth-Studio's list, with the modulation layers `img_mod.1`, `txt_mod.1`), "
        "musubi-tuner's, the attention alone (`to_q,to_k,to_v,to_out.0`); the trainable state of each in brackets:",
        "",
        "| settings | musubi-tuner | default targets | musubi-tuner's targets | attention only |",
        "|---|---:|---:|---:|---:|",
    ]
    for label, published, plans in result["peaks"]["musubi"]:
        cells = [f"{gib(p['stages']['train']['peak_bytes'])} ({gib(p['stages']['train']['trainable_bytes'])})"
                 for p in (plans["default"], plans["musubi"], plans["attention"])]
        lines.append(f"| {label} | {published} GB | " + " | ".join(cells) + " |")
    if result.get("errors"):
        lines += [
            "",
            "**Measured error** (one training step, and each stage-1 encoder's forward, run on this CPU at "
            + ("demo size" if size == "real" else "test size")
            + "; MiB of activations: the estimate, the storages the real step created, the heap in use above its start "
            "(the step after a warm-up step); error = (estimate - heap) / heap):",
            "",
            "| model | precision | what | estimate | real storages | heap | error |",
            "|---|---|---|---:|---:|---:|---:|",
        ]
        for row in result["errors"]:
            tracked, heap, error = _row_error(row["step"]["estimate"], row["step"]["measured"])
            lines.append(f"| {row['family']} | {row['precision']} | DiT LoRA step | {row['step']['estimate'] / 2**20:.2f} | "
                         f"{tracked} | {heap} | {error} |")
            if row["precision"] == "bf16":
                for slot, encoder in row["encoders"].items():
                    tracked, heap, error = _row_error(encoder["estimate"], encoder["measured"])
                    lines.append(f"| {row['family']} | bf16 | {slot} forward | {encoder['estimate'] / 2**20:.2f} | "
                                 f"{tracked} | {heap} | {error} |")
    return "\n".join(lines)


def measure(size: str, work: Path, with_errors: bool = True, echo: Any = print, only: Optional[tuple[str, ...]] = None,
            precisions: Optional[tuple[str, ...]] = None) -> dict[str, Any]:
    """The peaks and (where glibc tells the heap in use) the measured errors; `only` some families, `precisions` some
    labels (the smoke test's subset)."""
    result = {"size": size, "peaks": peaks(size, work, echo, only, precisions)}
    if with_errors and heap_reader() is not None:
        result["errors"] = errors(size, work, echo, only, precisions)
    return result


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=("real", "test"), default="real")
    parser.add_argument("--no-measure", action="store_true", help="the dry-run table alone, no measured steps")
    parser.add_argument("--write", action="store_true",
                        help=f"replace the section in {DOC.relative_to(ROOT)} and {MEMORY_DOC.relative_to(ROOT)}")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="memory-plan-") as work:
        text = report(measure(args.size, Path(work), not args.no_measure), args.size)
    print(text)
    if args.write:
        write_section(DOC, BEGIN, END, TITLE, text)
        write_section(MEMORY_DOC, BEGIN, END, "## The figures", text)
        print(f"wrote {DOC} and {MEMORY_DOC}")


if __name__ == "__main__":
    main()
