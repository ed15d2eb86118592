"""The dry run of a DiffSynth pipeline: what each stage holds, from DiffSynth's model configs on the meta device.

Each model of the command is its table entry's class built on the meta device with the entry's sizes (no weights
are read, and none need to be downloaded: models.planned_models), counted at the dtype the pipeline trains in
(DiffSynth loads every model in it), a model of `--fp8_models` at one byte a weight (DiffSynth's fp8 storage loads
every weight of its file in float8_e4m3fn). A stage holds the models the plan gives it; training adds the trained
parameters' gradients (in that dtype, as DiffSynth upcasts the LoRA to it), the optimizer's state (AdamW's two
moments in fp32 by default; --optimizer's own per parameter shape, train/optimizers.state_bytes: Adafactor's
factored rows and columns, ...) and with --ema_decay the moving average's fp32 copy (on the device, or in host
memory with --ema_device cpu). The LoRA is peft's, injected into the skeleton with the command's targets and rank,
so its size is the one the run trains. Activations are not counted: they depend on the kernels and the sample size,
and the run's own `--dry_run` of unitgraph's families measures them; this plan says what the weights and the
optimizer need.

With `--config_file X [--num_processes N]` (the accelerate config the run will be launched with) the training
stages are counted per process under its engine, as sharding.py trains: data parallel holds everything on every
process; DeepSpeed ZeRO-1 splits AdamW's moments and, for models not in fp32, the fp32 master copy of the trained
weights over the N processes, ZeRO-2 the gradients too, ZeRO-3 the trained models' weights too (the frozen
base under a LoRA included; one gathered layer at a time is not counted); FSDP2 splits the trained models'
weights, gradients, the optimizer's state and the moving average (no masters: it steps the weights' own dtype).
What the config offloads is counted as host memory, not on the device. Stage 1 trains nothing and is the same under
every engine.
"""

from __future__ import annotations

import math
from typing import Any

from .lora import target_modules

__all__ = ["memory_plan", "format_plan"]

GIB = 1024 ** 3


def _bytes_of(dtype: str) -> int:
    import torch

    return torch.empty((), dtype=getattr(torch, dtype)).element_size()


def _count(module: Any) -> int:
    return sum(p.numel() for p in module.parameters())


def _lora_shapes(skeleton: Any, targets: list[str], rank: int) -> list[tuple[int, ...]]:
    """The shapes of the LoRA's parameters DiffSynth's add_lora_to_model would inject (peft's matching of the target
    names)."""
    from peft import LoraConfig, inject_adapter_in_model

    config = LoraConfig(r=rank, lora_alpha=rank, target_modules=targets[0] if len(targets) == 1 else targets)
    model = inject_adapter_in_model(config, skeleton)
    return [tuple(p.shape) for n, p in model.named_parameters() if "lora_" in n]


def _optimizer_bytes(args: Any, shapes: list[tuple[int, ...]]) -> int:
    """What --optimizer keeps for the trained parameters of `shapes` (train/optimizers.state_bytes)."""
    from ..train.optimizers import parse_optimizer_args, state_bytes

    settings = parse_optimizer_args(args.optimizer_args)
    return sum(state_bytes(args.optimizer, settings, shape) for shape in shapes)


def memory_plan(setup: Any, engine: Any = None) -> dict[str, Any]:
    """{models: {attribute: {params, bytes, entry}}, stages: {stage: {models, weights, trained, gradients,
    optimizer, master, host, total}}, engine} in bytes, per process under `engine` (engine.Engine; data parallel
    when None): `total` on the device, `host` what the engine offloads to CPU memory."""
    from ..engine import Engine
    from ..memory_plan import EMA_BYTES_PER_PARAM
    from ..train.optimizers import optimizer_label

    engine = engine or Engine()
    args, plan, glue = setup.args, setup.plan, setup.glue
    width = _bytes_of(glue.dtype)
    table: dict[str, dict[str, Any]] = {}
    skeletons: dict[str, Any] = {}
    for model in setup.models:
        for attribute, skeleton in model.skeletons().items():
            n = _count(skeleton)
            skeletons[attribute] = skeleton
            table[attribute] = {"params": n, "bytes": n * (1 if model.fp8 else width), "file": model.label,
                                "class": type(skeleton).__name__, "fp8": model.fp8}
    shapes: list[tuple[int, ...]] = []  # of the trained parameters
    if args.lora_base_model and args.lora_base_model in skeletons:
        skeleton = skeletons[args.lora_base_model]
        shapes += _lora_shapes(skeleton, target_modules(skeleton, args.lora_target_modules), args.lora_rank)
    for name in args.trainable():
        if name in skeletons:
            shapes += [tuple(p.shape) for p in skeletons[name].parameters()]
    trained = sum(math.prod(shape) for shape in shapes)
    state = _optimizer_bytes(args, shapes)
    averaged = EMA_BYTES_PER_PARAM * trained if args.ema_decay is not None else 0

    wrapped = {m for m in [args.lora_base_model, *args.trainable()] if m}

    def stage(names: list[str], training: bool) -> dict[str, Any]:
        held = [n for n in names if n in table]
        lora = trained * width if training and args.lora_base_model else 0
        weights = sum(table[n]["bytes"] for n in held) + lora
        grads = trained * width if training else 0
        optimizer = state if training else 0
        ema = averaged if training else 0
        fsdp = engine.kind == "fsdp2"
        zero = engine.kind == "deepspeed" and engine.zero_stage >= 1  # a ZeRO optimizer keeps fp32 masters
        master = trained * 4 if training and glue.dtype != "float32" and zero else 0
        host = 0
        if training and engine.shards_trained:  # FSDP2 or ZeRO: each process 1/N of what the engine shards
            n = max(1, engine.processes)
            optimizer, master = -(-optimizer // n), -(-master // n)
            if fsdp:  # each process averages its shards
                ema = -(-ema // n)
            if fsdp or engine.zero_stage >= 2:
                grads = -(-grads // n)
            if engine.shards_frozen:  # FSDP2, ZeRO-3: the trained models' weights, a LoRA's frozen base included
                sharded = sum(table[m]["bytes"] for m in held if m in wrapped) + lora
                part = -(-sharded // n)
                weights -= sharded - (0 if engine.offload_params else part)
                host += part if engine.offload_params else 0
            if engine.offload_optimizer:  # FSDP2 offloads with the weights: its gradients are in CPU memory too
                host += optimizer + master + (grads if fsdp else 0)
                optimizer = master = 0
                grads = 0 if fsdp else grads
        if args.ema_device == "cpu":
            host, ema = host + ema, 0
        return {"models": held, "weights": weights, "trained_params": trained if training else 0,
                "gradients": grads, "optimizer": optimizer, "master": master, "ema": ema, "host": host,
                "total": weights + grads + optimizer + master + ema}

    stages = {"data_process": stage(plan.data_process_models, False), "train": stage(plan.train_models, True),
              "unsplit": stage(sorted(set(plan.data_process_models) | set(plan.train_models)), True)}
    return {"pipeline": glue.name, "dtype": glue.dtype, "models": table, "stages": stages,
            "optimizer": optimizer_label(args.optimizer),
            "engine": {**engine.to_json(), "processes": engine.processes}, "activations": "not counted"}


def format_plan(plan: dict[str, Any]) -> list[str]:
    engine = plan.get("engine") or {"kind": "ddp", "processes": 1}
    per = "" if engine["kind"] == "ddp" and engine.get("processes", 1) == 1 else \
        f"; training stages per process under {engine['name']} over {engine['processes']} processes"
    lines = [f"dry run: {plan['pipeline']} in {plan['dtype']} (DiffSynth's model configs on the meta device; "
             f"activations not counted{per})"]
    for name, info in plan["models"].items():
        lines.append(f"  {name:<14} {info['class']}: {info['params'] / 1e9:.3f} B params, {info['bytes'] / GIB:.2f} GiB "
                     f"{'in fp8 ' if info.get('fp8') else ''}({info['file']})")
    titles = {"data_process": "stage 1 (data_process)", "train": "stage 2 (train)", "unsplit": "unsplit (sft)"}
    for key, title in titles.items():
        s = plan["stages"][key]
        extra = ""
        if s["trained_params"]:
            extra = (f"; trains {s['trained_params'] / 1e6:.1f} M params: gradients {s['gradients'] / GIB:.2f} GiB, "
                     f"{plan.get('optimizer', 'AdamW')} {s['optimizer'] / GIB:.2f} GiB")
            if s.get("master"):
                extra += f", fp32 masters {s['master'] / GIB:.2f} GiB"
            if s.get("ema"):
                extra += f", EMA {s['ema'] / GIB:.2f} GiB"
        host = f" (+ {s['host'] / GIB:.2f} GiB offloaded to CPU memory)" if s.get("host") else ""
        lines.append(f"{title:<24} {', '.join(s['models']) or 'no model'}: weights {s['weights'] / GIB:.2f} GiB"
                     f"{extra}; total {s['total'] / GIB:.2f} GiB{host}")
    return lines
