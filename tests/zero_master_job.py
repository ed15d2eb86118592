"""One process of tests/test_zero_master.py's 2-process check (started by torch.distributed.run over gloo).

For ZeRO-1, -2 and -3, each process trains the same small fp32 model three AdamW steps under DeepSpeed twice: as
DeepSpeed makes it (an fp32 master copy of the process's partition beside the fp32 weights) and with the master
sharing the weights' partition (train/engines.share_fp32_master). `argv[1]` (a JSON file, written by the main
process) gets, per stage, each way's whole trained weights (as lists), the bytes sharing gave back and the
optimizer-state bytes held_bytes counts.
"""

from __future__ import annotations

import json
import os
import sys


def train(stage: int, share: bool) -> dict:
    import deepspeed
    import torch

    from unitgraph.backends.diffusion.train.engines import held_bytes, share_fp32_master

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
              "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}
    engine, optimizer, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    given_back = share_fp32_master(engine.optimizer) if share else 0
    start = gathered(engine.module, stage)
    rank = torch.distributed.get_rank()
    for step in range(3):
        generator = torch.Generator().manual_seed(100 * step + rank)
        x, y = torch.randn(2, 16, generator=generator), torch.randn(2, 4, generator=generator)
        loss = torch.nn.functional.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
    _, state = held_bytes({"model": engine.module}, engine.optimizer)
    weights = gathered(engine.module, stage)
    return {"weights": weights, "moved": weights != start, "given_back": given_back, "state": state}


def gathered(model, stage: int) -> dict:
    """Each weight whole, as lists of floats."""
    import deepspeed

    out = {}
    for name, param in model.named_parameters():
        with deepspeed.zero.GatheredParameters([param], enabled=stage == 3):
            out[name] = param.detach().clone().tolist()
    return out


def main(out: str) -> None:
    import deepspeed
    import torch

    deepspeed.init_distributed(dist_backend="gloo")
    report = {str(stage): {way: train(stage, way == "shared") for way in ("copied", "shared")}
              for stage in (1, 2, 3)}
    if torch.distributed.get_rank() == 0:
        with open(out, "w") as handle:
            json.dump(report, handle)
    torch.distributed.barrier()
    # a clean end: a process leaving with gloo's threads still up can abort ("terminate called without an active
    # exception") after its work is done, failing the run for nothing; it did so twice in fresh-clone runs even after
    # destroy_process_group (a C++ thread of the engines' still joinable at exit), so the process leaves without
    # running the interpreter's teardown, its report written and its output flushed
    torch.distributed.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1])
