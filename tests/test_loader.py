"""Stage 2's batching data path (backends/diffusion/data/batching.py, train/executor.py): buckets, seeded order, collation,
prefetch, and a batch of B giving the gradient of B accumulated steps."""

from __future__ import annotations

import csv
from collections import Counter
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

torch = pytest.importorskip("torch")
pytest.importorskip("diffusers")
pytest.importorskip("safetensors")

from qwen_family import QWEN, load_components  # noqa: E402
from unitgraph.backends.diffusion.data import batching as B  # noqa: E402
from unitgraph.backends.diffusion.train import executor as E  # noqa: E402
from unitgraph.backends.diffusion.cache.entries import write_entry  # noqa: E402
from unitgraph.backends.diffusion.randomness import permutation  # noqa: E402

SEED = 11


# ------------------------------------------------------------------------------------------------
# the epoch's order (no models)


def _keys(n: int) -> list[str]:
    return ["a" if i % 3 == 0 else "b" if i % 3 == 1 else "c" for i in range(n // 2)] + ["a"] * (n - n // 2)


@pytest.mark.parametrize("batch_size", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("n", [1, 7, 24, 25])
def test_each_element_once_per_epoch_and_batches_stay_in_their_bucket(n, batch_size):
    keys = _keys(n)
    for epoch in range(3):
        batches = B.bucket_batches(keys, batch_size, SEED, epoch)
        flat = [j for b in batches for j in b]
        assert sorted(flat) == list(range(n))  # exactly once
        assert all(len({keys[j] for j in b}) == 1 for b in batches)  # one bucket per batch
        assert all(1 <= len(b) <= batch_size for b in batches)
        partial = Counter(keys[b[0]] for b in batches if len(b) < batch_size)
        assert all(count == 1 for count in partial.values())  # at most one partial batch per bucket
        sizes = Counter(keys)
        for key, size in sizes.items():  # full batches: as many as fit
            assert sum(1 for b in batches if keys[b[0]] == key and len(b) == batch_size) == size // batch_size


def test_order_is_seeded_and_shuffled_within_and_across_buckets():
    keys = _keys(64)
    first = B.bucket_batches(keys, 4, SEED, 0)
    assert first == B.bucket_batches(keys, 4, SEED, 0)  # deterministic
    assert first != B.bucket_batches(keys, 4, SEED, 1)  # a new order each epoch
    assert first != B.bucket_batches(keys, 4, SEED + 1, 0)  # and per seed
    # within a bucket the samples are not in their natural order
    a_members = [j for b in first for j in b if keys[j] == "a"]
    assert a_members != sorted(a_members)
    # across buckets: the sequence of bucket labels is interleaved, not bucket after bucket
    labels = [keys[b[0]] for b in first]
    runs = 1 + sum(1 for x, y in zip(labels, labels[1:]) if x != y)
    assert runs > len(set(labels))
    # different epochs interleave the buckets differently
    assert [keys[b[0]] for b in B.bucket_batches(keys, 4, SEED, 1)] != labels or runs == 1


def test_batch_size_one_is_the_permutation_of_the_unbatched_loop():
    keys = _keys(30)
    for epoch in range(3):
        assert B.bucket_batches(keys, 1, SEED, epoch) == [[j] for j in permutation(30, SEED, "shuffle", epoch)]


def test_drop_last_drops_only_partial_batches():
    keys = ["x"] * 10 + ["y"] * 3
    kept = B.bucket_batches(keys, 4, SEED, 0)
    dropped = B.bucket_batches(keys, 4, SEED, 0, drop_last=True)
    assert [b for b in kept if len(b) == 4] == dropped
    assert sum(len(b) for b in dropped) == 8


def test_sharding_gives_every_rank_the_same_number_of_batches():
    batches = [[i] for i in range(7)]
    shards = [B.shard_batches(batches, r, 3) for r in range(3)]
    assert {len(s) for s in shards} == {3}
    got = sorted(b[0] for s in shards for b in s)
    assert set(got) == set(range(7)) and len(got) == 9 and got[:2] == [0, 0] and got[2:4] == [1, 1]  # 0 and 1 wrap around
    assert B.shard_batches(batches, 0, 1) == batches


def test_step_groups_and_micro_weights():
    batches = [[1, 2, 3, 4], [5, 6, 7, 8], [9, 10]]
    groups = B.step_groups(batches, 2)
    assert groups == [batches[:2], batches[2:]]
    assert B.micro_weights([4, 4]) == [0.5, 0.5]
    assert B.micro_weights([4, 2]) == pytest.approx([2 / 3, 1 / 3])
    assert B.micro_weights([1, 1, 1]) == pytest.approx([1 / 3] * 3)  # B = 1: loss / len(group), as today


def test_sample_keys_match_the_unbatched_loop():
    items = [B.CachedItem(0, "aa"), B.CachedItem(1, "bb")]
    elements = B.expand(items, 2)
    assert [e.sample_key for e in elements] == ["0:aa:0", "0:aa:1", "1:bb:0", "1:bb:1"]


# ------------------------------------------------------------------------------------------------
# collation (no models)


def _sample(length: int, tokens: int = 8, fill: float = 1.0, mask: bool = True):
    return {
        "input_latents": torch.full((1, tokens, 16), fill),
        "timestep": torch.tensor([fill * 100]),
        "prompt_emb": torch.full((1, length, 4), fill),
        "prompt_emb_mask": torch.ones(1, length, dtype=torch.long) if mask else None,
        "edit_latents": None,
        "img_shapes": [[(1, 4, 2)]],
        "steps": 2,
    }


def test_collate_stacks_pads_prompts_and_keeps_lists_per_sample():
    out = B.collate([_sample(3, fill=1.0), _sample(5, fill=2.0), _sample(4, fill=3.0, mask=False)], QWEN.pad)
    assert out["input_latents"].shape == (3, 8, 16) and out["timestep"].tolist() == [100.0, 200.0, 300.0]
    assert out["prompt_emb"].shape == (3, 5, 4)
    assert out["prompt_emb_mask"].tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 1, 1, 1, 0]]
    assert out["prompt_emb_mask"].dtype == torch.long
    assert torch.all(out["prompt_emb"][0, 3:] == 0) and torch.all(out["prompt_emb"][0, :3] == 1)
    assert out["edit_latents"] is None and out["img_shapes"] == [[(1, 4, 2)]] * 3 and out["steps"] == 2
    single = _sample(3)
    assert B.collate([single], QWEN.pad)["prompt_emb"] is single["prompt_emb"]  # one sample: untouched


def test_collate_refuses_what_cannot_be_batched():
    a, b = _sample(3), _sample(3, tokens=4)
    with pytest.raises(ValueError, match="input_latents: shapes differ"):
        B.collate([a, b], QWEN.pad)
    c = _sample(3)
    c["steps"] = 4
    with pytest.raises(ValueError, match="steps: values differ"):
        B.collate([a, c], QWEN.pad)
    d = _sample(3)
    d["edit_latents"] = torch.zeros(1, 8, 16)
    with pytest.raises(ValueError, match="None in some samples only"):
        B.collate([a, d], QWEN.pad)


def test_entry_signature_reads_shapes_from_the_header(tmp_path):
    def entry(name, h, w, length, steps=2, seed=0):
        values = {"latent_mean": torch.zeros(1, 4, 1, h, w), "prompt_emb": torch.zeros(1, length, 16),
                  "prompt_emb_mask": torch.ones(1, length, dtype=torch.long), "edit_latents": None,
                  "height": h * 4, "steps": steps, "seed": seed, "prompt": "some text"}
        write_entry(tmp_path / name, values, {"sample_id": name, "index": 0})
        return tmp_path / name

    sink = ["steps"]
    sig = lambda p: B.entry_signature(p, sink_keys=sink, pad=QWEN.pad)  # noqa: E731
    base = sig(entry("a", 16, 16, 5))
    assert sig(entry("b", 16, 16, 9, seed=3)) == base  # prompt length, seeds and strings do not split buckets
    assert sig(entry("c", 8, 16, 5)) != base  # another image shape does
    assert sig(entry("d", 16, 16, 5, steps=4)) != base  # a plain value the sink reads does
    assert B.read_safetensors_header(tmp_path / "a")["latent_mean"]["shape"] == [1, 4, 1, 16, 16]
    # the same grouping from loaded values (a stage without entry files at hand)
    from unitgraph.backends.diffusion.cache.entries import read_entry

    vsig = lambda p: B.value_signature(read_entry(p)[0], sink_keys=sink, pad=QWEN.pad)  # noqa: E731
    assert vsig(tmp_path / "a") == vsig(tmp_path / "b") != vsig(tmp_path / "c")
    assert vsig(tmp_path / "a") != vsig(tmp_path / "d")


def test_prefetch_thread_passes_errors_and_stops_early():
    def boom():
        raise RuntimeError("bad entry")

    with pytest.raises(RuntimeError, match="bad entry"):
        list(E._Prefetched([lambda: 1, boom], depth=1))
    source = E._Prefetched(((lambda i=i: i) for i in range(1000)), depth=2)
    got = []
    for value in source:
        got.append(value)
        if len(got) == 3:
            break
    source.close()
    assert got == [0, 1, 2] and not source._thread.is_alive()


# ------------------------------------------------------------------------------------------------
# on a real cache of test-size models

PROMPTS = ["a dog", "a red circle on a blue background", "a cat", "a small white dog running on green grass in the park",
           "a yellow square", "blue sky with white clouds over a field of flowers", "a bird", "a green square on a white background",
           "an old house in the forest, autumn leaves", "a red circle"]


@pytest.fixture(scope="module")
def mixed_dataset(tmp_path_factory) -> Path:
    """10 images: 7 squares of 64 px and 3 of 64 x 32, prompts of different lengths."""
    from PIL import Image

    folder = tmp_path_factory.mktemp("mixed")
    (folder / "images").mkdir()
    rows = []
    for i, prompt in enumerate(PROMPTS):
        size = (64, 32) if i % 3 == 2 else (64, 64)
        Image.new("RGB", size, (20 * i, 255 - 20 * i, 90)).save(folder / "images" / f"{i}.png")
        rows.append({"image": f"images/{i}.png", "prompt": prompt})
    with (folder / "metadata.csv").open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=["image", "prompt"])
        writer.writeheader()
        writer.writerows(rows)
    return folder


def _args(tiny: Path, folder: Path, **extra):
    from unitgraph.backends.diffusion.args import make_args

    kwargs = dict(dataset_base_path=str(folder), dataset_metadata_path=str(folder / "metadata.csv"), model_paths=str(tiny),
                  lora_base_model="dit", lora_target_modules="to_q,to_k,to_v,to_out.0", lora_rank=4, max_pixels=64 * 64,
                  seed=SEED, progress=False, plot=False, mixed_precision="no")  # the loader compared with fp32 models
    kwargs.update(extra)
    return make_args(**kwargs)


@pytest.fixture(scope="module")
def cache(tiny, mixed_dataset, tmp_path_factory) -> Path:
    from unitgraph.backends.diffusion.stages import run

    out = tmp_path_factory.mktemp("cache")
    run(_args(tiny, mixed_dataset, task="sft:data_process", output_path=str(out)), echo=lambda _t: None)
    return out


@pytest.fixture(scope="module")
def setup(tiny, cache):
    """(pipeline, plan, ctx, sink) for stage 2 of the LoRA-on-dit plan."""
    import unitgraph
    from unitgraph.backends.diffusion.context import ImageSize, UnitContext, UnitSettings

    pipeline = QWEN.pipeline("qwen_image")
    plan = unitgraph.split(pipeline.spec_pipeline, lora_base_model="dit")
    models = load_components(["dit", "scheduler"], model_paths=str(tiny), torch_dtype=torch.float32)
    ctx = UnitContext(models=models, settings=UnitSettings(image_size=ImageSize(None, None, 64 * 64), seed=SEED))
    return pipeline, plan, ctx, lambda ctx, **inputs: pipeline.loss(ctx, inputs)


def _data(setup, cache, **kwargs):
    pipeline, plan, _ctx, _sink = setup
    return E.Stage2Data.from_cache(pipeline, plan, cache, seed=SEED, pad=QWEN.pad, **kwargs)


@pytest.mark.slow
def test_real_cache_buckets_by_image_shape_not_prompt_length(setup, cache):
    data = _data(setup, cache, batch_size=4, dataset_repeat=2)
    assert [u.name for u in data.early_units] == ["NoiseInitializer", "LatentPacker", "TimestepSampler"]
    assert data.step_units == []
    buckets = data.buckets()
    assert sorted(len(v) for v in buckets.values()) == [6, 14]  # 3 wide and 7 square images, each twice
    for epoch in range(2):
        batches = data.batches(epoch)
        keys = [e.sample_key for b in batches for e in b]
        assert sorted(keys) == sorted(e.sample_key for e in data.elements) and len(set(keys)) == len(keys)
        for batch in batches:
            assert len({data.bucket_key(e.item) for e in batch}) == 1
    # two processes: every element on some rank, the same number of batches on each
    shards = [data.batches(0, rank, 2) for rank in range(2)]
    assert len(shards[0]) == len(shards[1])
    assert {e.sample_key for s in shards for b in s for e in b} == {e.sample_key for e in data.elements}


@pytest.mark.slow
def test_buckets_from_loaded_values_match_buckets_from_headers(setup, cache):
    by_header = _data(setup, cache, batch_size=4)
    by_values = _data(setup, cache, batch_size=4, entry_path=None)
    assert by_values.entry_path is None
    groups = lambda d: sorted(sorted(v) for v in d.buckets().values())  # noqa: E731
    assert groups(by_header) == groups(by_values)
    assert [[e.sample_key for e in b] for b in by_header.batches(3)] == [[e.sample_key for e in b] for b in by_values.batches(3)]


@pytest.mark.slow
def test_batch_size_one_gives_the_unsplit_runs_inputs(setup, cache, tiny, mixed_dataset):
    """Stage 2 at batch size 1 (cached values, the plan's bindings, the early units ahead of the step) hands
    the sink exactly what the unsplit run computes by running every unit on the raw sample."""
    from unitgraph.backends.diffusion.config import RunConfig
    from unitgraph.backends.diffusion.stages import Item, LiveProvider

    pipeline, plan, ctx, _sink = setup
    cfg = RunConfig.from_args(_args(tiny, mixed_dataset, task="sft", output_path="unused"))
    live = LiveProvider(cfg, plan)
    vae = load_components(["vae", "text_encoder", "tokenizer"], model_paths=str(tiny), torch_dtype=torch.float32)
    data = _data(setup, cache, batch_size=1, dataset_repeat=2)
    expected_order = [data.elements[j] for j in permutation(len(data.elements), SEED, "shuffle", 1)]
    got = list(data.iterate(1, ctx, prefetch=2))
    assert [b.elements[0] for b in got] == expected_order
    live_ctx = type(ctx)(models={**ctx.models, **vae}, settings=ctx.settings)
    for batch in got[:6]:
        element = batch.elements[0]
        live_ctx.epoch, live_ctx.sample_key = 1, element.sample_key
        want = live.sink_inputs(Item(element.item.index, element.item.sample_id), live_ctx)
        assert set(want) == set(batch.inputs)
        for name, value in want.items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(value, batch.inputs[name]), name
            else:
                assert value == batch.inputs[name], name


def test_cast_of_cached_values():
    values = {"a": torch.ones(2, dtype=torch.bfloat16), "mask": torch.ones(2, dtype=torch.long),
              "nested": [torch.zeros(1, dtype=torch.float16), ("x", 3)], "n": 4}
    out = {k: B.cast_floating(v, torch.float32) for k, v in values.items()}
    assert out["a"].dtype == torch.float32 and out["mask"].dtype == torch.long
    assert out["nested"][0].dtype == torch.float32 and out["nested"][1] == ("x", 3) and out["n"] == 4


@pytest.mark.slow
def test_a_bf16_cache_is_read_in_the_models_dtype(setup, cache):
    data = _data(setup, cache, dtype=torch.bfloat16)  # stands in for a cache stored in bf16
    values = data.read(data.items[0])
    assert values["input_latents"].dtype == torch.bfloat16 and values["prompt_emb_mask"].dtype == torch.long


@pytest.mark.slow
def test_prefetch_modes_give_identical_batches(setup, cache):
    _pipeline, _plan, ctx, _sink = setup
    data = _data(setup, cache, batch_size=3, keep_in_memory=True)
    runs = [list(data.iterate(0, ctx, prefetch=0)), list(data.iterate(0, ctx, prefetch=2)),
            list(data.iterate(0, ctx, prefetch=2, workers=1))]
    for other in runs[1:]:
        assert [b.sample_keys for b in other] == [b.sample_keys for b in runs[0]]
        for a, b in zip(runs[0], other):
            for name, value in a.inputs.items():
                if isinstance(value, torch.Tensor):
                    assert torch.equal(value, b.inputs[name]), name
                else:
                    assert value == b.inputs[name], name


@pytest.mark.slow
def test_a_batch_of_b_gives_the_gradient_of_b_accumulated_steps(setup, cache):
    """Full training of the DiT (every weight gets a gradient); prompts of different lengths in one batch."""
    _pipeline, _plan, ctx, sink = setup
    dit = ctx.models["dit"]
    dit.requires_grad_(True)
    dit.train()
    try:
        data = _data(setup, cache, batch_size=4)
        batches = [b for b in data.batches(0) if len(b) == 4]
        assert batches
        batch = batches[0]
        states = [data.prepare(e, 0, data.early_context(ctx)) for e in batch]
        singles = [data.sink_inputs(s) for s in states]
        lengths = {int(s["prompt_emb"].shape[1]) for s in singles}
        assert len(lengths) > 1  # padding is exercised
        batched = B.collate(singles, QWEN.pad)
        # per-sample randomness: row k of the batch is sample k's own noise and timestep
        for k, single in enumerate(singles):
            assert torch.equal(batched["noise"][k], single["noise"][0])
            assert torch.equal(batched["timestep"][k:k + 1], single["timestep"])

        params = [p for p in dit.parameters() if p.requires_grad]
        dit.zero_grad(set_to_none=True)
        loss = sink(ctx, **batched)
        loss.backward()
        grad_batch = [torch.zeros_like(p) if p.grad is None else p.grad.detach().clone() for p in params]
        dit.zero_grad(set_to_none=True)
        losses = []
        for single in singles:
            one = sink(ctx, **single)
            (one / len(singles)).backward()
            losses.append(float(one.detach()))
        grad_steps = [torch.zeros_like(p) if p.grad is None else p.grad.detach().clone() for p in params]
        dit.zero_grad(set_to_none=True)
        assert float(loss.detach()) == pytest.approx(sum(losses) / len(losses), abs=1e-6)
        worst = max(float((a - b).abs().max()) for a, b in zip(grad_batch, grad_steps))
        print(f"max |grad(batch of {len(singles)}) - grad({len(singles)} accumulated steps)| = {worst:.2e}")
        assert worst <= 1e-5
        assert max(float(g.abs().max()) for g in grad_batch) > 1e-3  # the gradient is not trivially zero
    finally:
        dit.requires_grad_(False)
        dit.eval()


@pytest.mark.slow
def test_units_that_call_models_run_per_sample_at_step_time(tiny, mixed_dataset, tmp_path):
    """A trainable text encoder: PromptEncoder runs in stage 2, per sample, before the batched sink;
    the batch's gradient (DiT LoRA-free full weights and text encoder) equals B accumulated steps."""
    import unitgraph
    from unitgraph.backends.diffusion import stages
    from unitgraph.backends.diffusion.context import ImageSize, UnitContext, UnitSettings

    stages.run(_args(tiny, mixed_dataset, task="sft:data_process", output_path=str(tmp_path / "cache"),
                     trainable_models="text_encoder"), echo=lambda _t: None)
    pipeline = QWEN.pipeline("qwen_image")
    plan = unitgraph.split(pipeline.spec_pipeline, trainable_models=["text_encoder"], lora_base_model="dit")
    data = E.Stage2Data.from_cache(pipeline, plan, tmp_path / "cache", seed=SEED, batch_size=4, pad=QWEN.pad)
    assert [u.name for u in data.step_units] == ["PromptEncoder"]
    assert "NoiseInitializer" in [u.name for u in data.early_units]
    models = load_components(["dit", "text_encoder", "tokenizer", "scheduler"], model_paths=str(tiny), torch_dtype=torch.float32)
    for slot in ("dit", "text_encoder"):
        models[slot].requires_grad_(True)
        models[slot].train()
    ctx = UnitContext(models=models, settings=UnitSettings(image_size=ImageSize(None, None, 64 * 64), seed=SEED))
    sink = lambda ctx, **inputs: pipeline.loss(ctx, inputs)  # noqa: E731

    batch = next(b for b in data.batches(0) if len(b) == 4)
    early = data.early_context(ctx, ctx.device)
    params = [p for slot in ("dit", "text_encoder") for p in models[slot].parameters()]

    def grads():
        out = [torch.zeros_like(p) if p.grad is None else p.grad.detach().clone() for p in params]
        for p in params:
            p.grad = None
        return out

    batched = data.finish(E.Batch(0, batch, prepared=[data.prepare(e, 0, early) for e in batch]), ctx)
    assert len({int(m.sum()) for m in batched["prompt_emb_mask"]}) > 1  # prompts of different lengths, padded
    sink(ctx, **batched).backward()
    grad_batch = grads()
    for element in batch:
        single = data.finish(E.Batch(0, [element], prepared=[data.prepare(element, 0, early)]), ctx)
        (sink(ctx, **single) / len(batch)).backward()
    grad_steps = grads()
    worst = max(float((a - b).abs().max()) for a, b in zip(grad_batch, grad_steps))
    assert worst <= 1e-5
    te = sum(float(g.abs().sum()) for g, p in zip(grad_batch, params) if any(p is q for q in models["text_encoder"].parameters()))
    assert te > 0  # the text encoder does get a gradient through the padded batch


@given(st.integers(min_value=0, max_value=12), st.integers(min_value=1, max_value=5),
       st.one_of(st.none(), st.integers(min_value=0, max_value=11)))
def test_batches_made_in_runs_come_in_order_and_an_error_at_its_own_turn(n, run, failing):
    """executor._in_runs: the results of prefetch=0, in order; jobs are called at most `run` ahead of the
    result asked for; a failing job's error comes after every result before it, and no later job is called."""
    called: list[int] = []
    handed: list[int] = []

    def job(k):
        def call():
            assert len(called) < len(handed) + run  # never more than a run ahead of what was taken
            called.append(k)
            if k == failing:
                raise ValueError(f"job {k}")
            return k
        return call

    results = E._in_runs((job(k) for k in range(n)), run)
    if failing is not None and failing < n:
        with pytest.raises(ValueError, match=f"job {failing}"):
            for value in results:
                handed.append(value)
        assert handed == list(range(failing)) and called == list(range(failing + 1))
    else:
        for value in results:
            handed.append(value)
        assert handed == called == list(range(n))
