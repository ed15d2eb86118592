"""One process of tests/test_shard_loading.py's 2-process check (started by torch.distributed.run over gloo).

Each process builds the test-size Qwen-Image DiT without weights, adds a LoRA, shards it with FSDP2 the way stage 2
does (the blocks, then the model) and reads its weights straight into its shards. The whole tensors are then
gathered, and the main process compares them with the same DiT loaded whole by `from_pretrained` with the same
LoRA added: `argv[3]` (a JSON file) gets, per dtype, the names that differ and the share of bytes each process read.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main(folder: str, dtype_names: str, out: str) -> None:
    import torch
    import torch.distributed as dist
    from diffusers import QwenImageTransformer2DModel
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from unitgraph.backends.diffusion.models.folders import ComponentSource
    from unitgraph.backends.diffusion.models.loading import keep_in_fp32
    from unitgraph.backends.diffusion.models.lora import add_lora
    from unitgraph.backends.diffusion.models.precision import adapters_to_fp32
    from unitgraph.backends.diffusion.models.shards import fill_shards, kept_tensors, load_skeleton
    from unitgraph.backends.diffusion.train.engines import shard_units

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    source = ComponentSource(slot="dit", path=Path(folder) / "transformer", class_name="QwenImageTransformer2DModel")
    report = {}
    for name in dtype_names.split(","):
        dtype = getattr(torch, name)
        keep = keep_in_fp32(QwenImageTransformer2DModel, "diffusers", dtype)
        model = load_skeleton(source, QwenImageTransformer2DModel, dtype, keep)
        add_lora(model, "dit", ["to_q", "to_k"], 4, 4, seed=7)
        adapters_to_fp32(model)
        kept_tensors(model)
        for block in shard_units(model):
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        record = fill_shards(model, "cpu")
        whole = {n: p.full_tensor() if hasattr(p, "full_tensor") else p.detach()
                 for n, p in [*model.named_parameters(), *model.named_buffers()]}
        held = sum(p.to_local().numel() for p in model.parameters()) / sum(p.numel() for p in model.parameters())
        if dist.get_rank() == 0:
            reference = QwenImageTransformer2DModel.from_pretrained(str(source.path), torch_dtype=dtype)
            add_lora(reference, "dit", ["to_q", "to_k"], 4, 4, seed=7)
            adapters_to_fp32(reference)
            expected = dict([*reference.named_parameters(), *reference.named_buffers()])
            differ = sorted(set(expected) ^ set(whole))
            differ += [n for n in expected if n in whole and (expected[n].dtype != whole[n].dtype
                                                              or not torch.equal(expected[n], whole[n]))]
            trained = sorted(n for n, p in model.named_parameters() if p.requires_grad)
            report[name] = {"differ": differ, "read": record.read_bytes / record.total_bytes, "held": held,
                            "trained": trained, "lora": sorted(n for n in expected if "lora_" in n)}
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(report))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:4])
