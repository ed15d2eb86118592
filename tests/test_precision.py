"""Precision and memory (docs/memory.md): --mixed_precision, fp8 storage, fp32 adapters, checkpointing, block swap.

What matters, and is checked here on the test-size Qwen-Image models:
- the precision follows the flag, else accelerate's launch flag or config, else bf16; fp16 without CUDA is one line;
- frozen models load directly in the compute dtype, trained parameters (LoRA, --trainable_models) are fp32, and
  stage 1 stores its entries in the compute dtype;
- split training is exactly the unsplit run at bf16, with fp8 storage too, and at fp32;
- --fp8_models really stores the named frozen model in fp8 (and changes the numbers), in either of DiffSynth's
  spellings, and refuses a trained model or a name that loads nothing;
- gradient checkpointing, with and without offload, trains the same numbers;
- --blocks_to_swap is checked against the model's blocks and is a note on a machine without an accelerator.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("diffusers")
pytest.importorskip("peft")

from safetensors.torch import load_file  # noqa: E402

from clitools import cli, one_error_line  # noqa: E402
from unitgraph.backends.diffusion.args import make_args  # noqa: E402
from unitgraph.backends.diffusion.cache.cache import Cache  # noqa: E402
from unitgraph.backends.diffusion.config import RunConfig, default_precision, mixed_precision  # noqa: E402
from unitgraph.backends.diffusion.data.dataset import write_synthetic_dataset  # noqa: E402
from unitgraph.backends.diffusion.errors import BackendError  # noqa: E402
from unitgraph.backends.diffusion.models.stage import load_models  # noqa: E402
from unitgraph.backends.diffusion.stages import run  # noqa: E402
from unitgraph.backends.diffusion.train.loop import read_loss_csv  # noqa: E402

SIZE = 32
TARGETS = "to_q,to_k,to_v,to_out.0"


def quiet(_text: str) -> None:
    pass


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("precision-data")
    write_synthetic_dataset(folder, count=3, size=SIZE, seed=4)
    return folder


def flags(tiny: Path, data: Path, **extra) -> dict:
    kwargs = dict(dataset_base_path=str(data), dataset_metadata_path=str(data / "metadata.csv"), model_paths=str(tiny),
                  lora_base_model="dit", lora_target_modules=TARGETS, lora_rank=4, max_pixels=SIZE * SIZE, seed=3,
                  learning_rate=1e-3, progress=False, plot=False,
                  mixed_precision="bf16")  # DiffSynth's precision, whatever this machine's default is
    kwargs.update(extra)
    return kwargs


def train(out: Path, task: str, tiny: Path, data: Path, **extra):
    return run(make_args(task=task, output_path=str(out), **flags(tiny, data, **extra)), echo=quiet)


def losses(folder: Path) -> list[float]:
    return [row["loss"] for row in read_loss_csv(folder / "loss.csv")]


def assert_same_training(a: Path, b: Path) -> None:
    assert losses(a) == losses(b) and losses(a)  # exact: the same code on the same values in the same context
    wa, wb = load_file(str(a / "epoch-0.safetensors")), load_file(str(b / "epoch-0.safetensors"))
    assert set(wa) == set(wb) and wa
    for key in wa:
        assert torch.equal(wa[key], wb[key]), key


# --- which precision -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("flag, env, expected", [
    (None, None, "default"),  # DiffSynth's bf16 where the device has bf16 kernels, else fp32
    ("no", None, "no"),
    (None, "bf16", "bf16"),  # accelerate launch --mixed_precision bf16, or its config
    (None, "no", "default"),  # accelerate launch sets "no" when nothing asked: not a request for fp32
    ("no", "bf16", "no"),  # unitgraph's own flag wins
])
def test_the_precision_follows_the_flag_then_accelerate_then_the_device(flag, env, expected):
    args = make_args(task="sft", lora_base_model="dit", mixed_precision=flag)
    expected = default_precision() if expected == "default" else expected
    assert mixed_precision(args, {} if env is None else {"ACCELERATE_MIXED_PRECISION": env}) == expected


def test_the_default_is_bf16_only_where_the_device_has_bf16_kernels(monkeypatch):
    """On a CPU without oneDNN's bf16 kernels torch emulates bf16 (45-60 times slower here): the default is fp32
    there, said in one line; with the kernels, or on CUDA, it is DiffSynth's bf16."""
    from unitgraph.backends.diffusion import config

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(config, "cpu_has_bf16", lambda: False)
    assert config.default_precision() == "no"
    args = make_args(task="sft", lora_base_model="dit")
    assert "--mixed_precision bf16" in config.precision_note(args, "no")
    assert config.precision_note(make_args(task="sft", lora_base_model="dit", mixed_precision="no"), "no") is None
    monkeypatch.setattr(config, "cpu_has_bf16", lambda: True)
    assert config.default_precision() == "bf16" and config.precision_note(args, "bf16") is None
    monkeypatch.setattr(config, "cpu_has_bf16", lambda: False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert config.default_precision() == "bf16"


def test_fp16_without_an_accelerator_and_a_bad_value_are_one_line(capsys, tiny, data, tmp_path):
    base = ["train", "--task", "sft", "--model_paths", str(tiny), "--dataset_base_path", str(data),
            "--dataset_metadata_path", str(data / "metadata.csv"), "--lora_base_model", "dit",
            "--output_path", str(tmp_path / "out")]
    code, _, err = cli(capsys, *base, "--mixed_precision", "fp16")
    one_error_line(code, err, "--mixed_precision fp16", "CUDA")
    code, _, err = cli(capsys, *base, "--mixed_precision", "fp8")
    one_error_line(code, err, "--mixed_precision must be one of no, fp16, bf16")
    assert not (tmp_path / "out").exists()


# --- dtypes ------------------------------------------------------------------------------------------------


def test_frozen_models_load_in_the_compute_dtype_and_trained_ones_in_fp32(tiny, data):
    cfg = RunConfig.from_args(make_args(task="sft", **flags(tiny, data, trainable_models="text_encoder")))
    assert cfg.precision.mixed == "bf16" and cfg.units.dtype == "bfloat16"
    models = load_models(cfg, ["vae", "text_encoder", "dit"], training=True, device=torch.device("cpu"))
    assert {p.dtype for p in models["vae"].parameters()} == {torch.bfloat16}
    assert {p.dtype for p in models["dit"].parameters()} == {torch.bfloat16}
    assert {p.dtype for p in models["text_encoder"].parameters()} == {torch.float32}  # trained in full
    stage1 = load_models(cfg, ["text_encoder"], training=False, device=torch.device("cpu"))
    assert {p.dtype for p in stage1["text_encoder"].parameters()} == {torch.bfloat16}  # frozen where it does not train


def test_stage1_stores_the_compute_dtype_and_the_lora_trains_in_fp32(tiny, data, tmp_path):
    result = train(tmp_path / "split", "sft:split", tiny, data)
    cache = Cache(result.cache_path)
    manifest = cache.read_manifest()
    assert manifest.key_settings["dtype"] == "bfloat16"
    values = cache.load_entry(next(iter(manifest.entries.values())), "an entry")
    floating = {k: v.dtype for k, v in values.items() if isinstance(v, torch.Tensor) and v.is_floating_point()}
    assert floating and set(floating.values()) == {torch.bfloat16}, floating
    saved = load_file(str(result.last_checkpoint))
    assert saved and {v.dtype for v in saved.values()} == {torch.float32}


# --- split == unsplit at each precision -------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("extra", [{"mixed_precision": "bf16"}, {"mixed_precision": "no"},
                                   {"fp8_models": "dit,text_encoder,vae"}],
                         ids=["bf16", "fp32", "bf16-fp8"])
def test_split_equals_unsplit_at_each_precision(extra, tiny, data, tmp_path):
    train(tmp_path / "unsplit", "sft", tiny, data, **extra)
    train(tmp_path / "split", "sft:split", tiny, data, **extra)
    assert_same_training(tmp_path / "unsplit", tmp_path / "split")


@pytest.mark.slow
def test_fp8_storage_is_real_and_changes_the_numbers(tiny, data, tmp_path):
    cfg = RunConfig.from_args(make_args(task="sft", **flags(tiny, data, fp8_models="dit,vae")))
    assert cfg.precision.fp8 == ("dit", "vae")
    models = load_models(cfg, ["vae"], training=False, device=torch.device("cpu"))
    dtypes = {p.dtype for p in models["vae"].parameters()}
    assert torch.float8_e4m3fn in dtypes and torch.bfloat16 in dtypes  # convolutions fp8; norms stay
    bf16 = train(tmp_path / "bf16", "sft", tiny, data)
    fp8 = train(tmp_path / "fp8", "sft", tiny, data, fp8_models="dit")
    assert losses(tmp_path / "bf16") != losses(tmp_path / "fp8")
    assert {v.dtype for v in load_file(str(fp8.last_checkpoint)).values()} == {torch.float32}
    assert set(load_file(str(fp8.last_checkpoint))) == set(load_file(str(bf16.last_checkpoint)))


def test_fp8_models_in_diffsynths_path_form_and_its_refusals(tiny, data, tmp_path):
    components = json.dumps([str(tiny / sub) for sub in ("transformer", "vae", "text_encoder", "tokenizer", "scheduler")])
    cfg = RunConfig.from_args(make_args(task="sft", **flags(tiny, data, model_paths=components,
                                                             fp8_models=str(tiny / "transformer"))))
    assert cfg.precision.fp8 == ("dit",)
    ids = "Qwen/Qwen-Image:transformer/diffusion_pytorch_model*.safetensors,Qwen/Qwen-Image:vae/*.safetensors"
    by_id = RunConfig.from_args(make_args(task="sft", **flags(tiny, data, model_paths=None, model_id_with_origin_paths=ids,
                                                               fp8_models=ids)))
    assert by_id.precision.fp8 == ("dit", "vae")  # DiffSynth's form: the same ids, read by their folders
    with pytest.raises(BackendError, match="text_encoder is in --trainable_models"):
        RunConfig.from_args(make_args(task="sft", **flags(tiny, data, trainable_models="text_encoder",
                                                          fp8_models="text_encoder")))
    with pytest.raises(BackendError, match="names no model this run loads"):
        RunConfig.from_args(make_args(task="sft", **flags(tiny, data, fp8_models="unet")))
    with pytest.raises(BackendError, match="names no model this run loads"):
        RunConfig.from_args(make_args(task="sft", **flags(tiny, data, model_paths=components,
                                                          fp8_models=str(tmp_path / "elsewhere"))))


# --- activations ----------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_gradient_checkpointing_with_and_without_offload_trains_the_same_numbers(tiny, data, tmp_path):
    train(tmp_path / "plain", "sft:split", tiny, data)
    train(tmp_path / "ckpt", "sft:split", tiny, data, use_gradient_checkpointing=True)
    train(tmp_path / "offload", "sft:split", tiny, data, use_gradient_checkpointing_offload=True)
    assert_same_training(tmp_path / "plain", tmp_path / "ckpt")
    assert_same_training(tmp_path / "plain", tmp_path / "offload")


def test_gradient_checkpointing_is_on_in_the_trained_model(tiny, data, monkeypatch):
    from unitgraph.backends.diffusion.models import precision

    turned_on = []
    real = precision.enable_checkpointing
    monkeypatch.setattr(precision, "enable_checkpointing", lambda model: turned_on.append(type(model).__name__) or real(model))
    cfg = RunConfig.from_args(make_args(task="sft", **flags(tiny, data, use_gradient_checkpointing_offload=True)))
    assert cfg.optim.gradient_checkpointing and cfg.precision.checkpoint_offload
    from unitgraph.backends.diffusion.session import make_accelerator, plan_for
    from unitgraph.backends.diffusion.train.loop import prepare_models

    plan = plan_for(cfg)
    models = load_models(cfg, plan.train_models, training=True, device=torch.device("cpu"))
    wrapped, _, _ = prepare_models(cfg, plan, models, make_accelerator(cfg))
    assert turned_on == ["QwenImageTransformer2DModel"]
    assert models["dit"].gradient_checkpointing is True


# --- block swap ----------------------------------------------------------------------------------------------


def test_blocks_to_swap_is_checked_and_a_note_without_an_accelerator(tiny, data, tmp_path):
    from unitgraph.backends.diffusion.models.precision import swap_blocks, transformer_blocks

    cfg = RunConfig.from_args(make_args(task="sft", **flags(tiny, data)))
    dit = load_models(cfg, ["dit"], training=True, device=torch.device("cpu"))["dit"]
    count = len(transformer_blocks(dit))
    assert count >= 2
    notes: list[str] = []
    assert swap_blocks(dit, "dit", 1, torch.device("cpu"), notes.append) == [count - 1]
    assert len(notes) == 1 and "no accelerator" in notes[0]
    with pytest.raises(BackendError, match=f"dit has {count} transformer blocks"):
        swap_blocks(dit, "dit", count, torch.device("cpu"))
    with pytest.raises(BackendError, match="give --lora_base_model"):
        RunConfig.from_args(make_args(task="sft", **flags(tiny, data, lora_base_model=None, trainable_models="dit",
                                                          blocks_to_swap=1)))


@pytest.mark.slow
def test_blocks_to_swap_on_a_cpu_changes_nothing(tiny, data, tmp_path):
    train(tmp_path / "plain", "sft:split", tiny, data)
    lines: list[str] = []
    run(make_args(task="sft:split", output_path=str(tmp_path / "swap"), **flags(tiny, data, blocks_to_swap=1)),
        echo=lines.append)
    assert any("--blocks_to_swap 1: no accelerator here" in line for line in lines)
    assert_same_training(tmp_path / "plain", tmp_path / "swap")


def test_fp8_storage_of_a_stage1_model_is_part_of_the_cache_key(tiny, data, tmp_path):
    cache = tmp_path / "cache"
    train(cache, "sft:data_process", tiny, data)
    again = train(cache, "sft:data_process", tiny, data, fp8_models="vae")
    assert again.computed_indices == [0, 1, 2] and "--fp8_models vae now, no --fp8_models in the cache" in again.stage1_reason
    dit_only = train(cache, "sft:data_process", tiny, data, fp8_models="vae,dit")  # the DiT is not a stage-1 model
    assert dit_only.cache_reused
    with pytest.raises(BackendError, match="no --fp8_models now, --fp8_models vae in the cache"):
        train(tmp_path / "t", "sft:train", tiny, cache, dataset_metadata_path=None)


def test_an_fp8_linear_keeps_only_its_fp8_weight_for_the_backward_pass():
    """diffusers' layerwise casting leaves each layer's compute-dtype copy to autograd until the backward pass;
    ours saves the fp8 weight itself (the same numbers: the product is taken with the same cast)."""
    from peft import LoraConfig, inject_adapter_in_model

    from unitgraph.backends.diffusion.models.precision import adapters_to_fp32, store_fp8

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64)).to(torch.bfloat16)
    inject_adapter_in_model(LoraConfig(r=4, target_modules=["0", "2"], init_lora_weights=False), model)
    for name, param in model.named_parameters():
        param.requires_grad_("lora_" in name)
    adapters_to_fp32(model)
    reference = {n: p.detach().clone() for n, p in model.named_parameters()}
    assert store_fp8(model, "m", "bfloat16") == 64 * 256 * 2
    saved: list[torch.Tensor] = []

    def pack(t):
        saved.append(t)
        return t

    x = torch.randn(8, 64)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(x.to(torch.bfloat16)).float().pow(2).mean()
    weight_like = [t for t in saved if t.shape in ((256, 64), (64, 256))]
    assert weight_like and {t.dtype for t in weight_like} == {torch.float8_e4m3fn}
    loss.backward()
    # the same gradients as the unsplit arithmetic: bf16 weights rounded through fp8, no hooks
    plain = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64)).to(torch.bfloat16)
    inject_adapter_in_model(LoraConfig(r=4, target_modules=["0", "2"], init_lora_weights=False), plain)
    with torch.no_grad():
        for name, param in plain.named_parameters():
            value = reference[name]
            param.data = value.to(torch.float8_e4m3fn).to(torch.bfloat16) if "base_layer.weight" in name else value
            param.requires_grad_("lora_" in name)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        plain(x.to(torch.bfloat16)).float().pow(2).mean().backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert grads and all(torch.equal(g, dict(plain.named_parameters())[n].grad) for n, g in grads.items())


def _convs(channels: int = 8) -> "torch.nn.Module":
    return torch.nn.Sequential(torch.nn.Conv2d(4, channels, 3, padding=1), torch.nn.SiLU(),
                               torch.nn.Conv2d(channels, channels, 3, stride=2, padding=1, groups=2), torch.nn.SiLU(),
                               torch.nn.Conv2d(channels, 4, 1)).to(torch.bfloat16)


def test_an_fp8_convolution_keeps_only_its_fp8_weight_and_computes_the_unsplit_gradients():
    """A UNet's frozen convolutions train LoRA through them: theirs is the stored-weight path too (the input's gradient
    taken from the fp8 weight cast again), with the gradients of plain bf16 arithmetic on fp8-rounded weights."""
    from peft import LoraConfig, inject_adapter_in_model

    from unitgraph.backends.diffusion.models.precision import adapters_to_fp32, store_fp8

    targets = ["0", "4"]  # the strided, grouped convolution between them trains nothing but passes the gradient on
    torch.manual_seed(0)
    model = _convs()
    inject_adapter_in_model(LoraConfig(r=2, target_modules=targets, init_lora_weights=False), model)
    for name, param in model.named_parameters():
        param.requires_grad_("lora_" in name)
    adapters_to_fp32(model)
    reference = {n: p.detach().clone() for n, p in model.named_parameters()}
    assert store_fp8(model, "m", "bfloat16") == 8 * 4 * 9 + 8 * 4 * 9 + 4 * 8
    saved: list[torch.Tensor] = []

    def pack(t):
        saved.append(t)
        return t

    x = torch.randn(2, 4, 8, 8)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(x.to(torch.bfloat16)).float().pow(2).mean()
    frozen = lambda n: n.endswith("weight") and "lora_" not in n  # noqa: E731
    base_shapes = {tuple(p.shape) for n, p in model.named_parameters() if frozen(n)}
    weight_like = [t for t in saved if tuple(t.shape) in base_shapes]
    assert weight_like and {t.dtype for t in weight_like} == {torch.float8_e4m3fn}
    loss.backward()
    plain = _convs()
    inject_adapter_in_model(LoraConfig(r=2, target_modules=targets, init_lora_weights=False), plain)
    with torch.no_grad():
        for name, param in plain.named_parameters():
            value = reference[name]
            param.data = value.to(torch.float8_e4m3fn).to(torch.bfloat16) if frozen(name) else value
            param.requires_grad_("lora_" in name)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        plain(x.to(torch.bfloat16)).float().pow(2).mean().backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert len(grads) == 2 * len(targets)
    assert all(torch.equal(g, dict(plain.named_parameters())[n].grad) for n, g in grads.items())


def test_convolutions_the_stored_path_cannot_take_keep_diffusers_hook():
    from unitgraph.backends.diffusion.models.precision import store_fp8

    model = torch.nn.Sequential(torch.nn.Conv2d(4, 4, 3, padding="same"), torch.nn.Conv2d(4, 4, 3, padding=1,
                                padding_mode="reflect"), torch.nn.ConvTranspose2d(4, 4, 2, stride=2),
                                torch.nn.Conv2d(4, 4, 3, padding=1)).to(torch.bfloat16).requires_grad_(False)
    store_fp8(model, "m", "bfloat16")
    hooked = [hasattr(m, "_diffusers_hook") for m in model]
    assert hooked == [True, True, True, False] and "forward" in vars(model[3])
    assert model(torch.randn(1, 4, 6, 6, dtype=torch.bfloat16)).shape == (1, 4, 12, 12)


def test_a_swapped_linear_computes_the_same_and_keeps_only_its_stored_weight():
    """--blocks_to_swap routes a block's frozen Linear layers through the same stored-weight function with a target
    device; on this CPU the device is the CPU itself, so what is checked is the arithmetic and what autograd keeps."""
    from unitgraph.backends.diffusion.models.precision import _stored_forward

    torch.manual_seed(1)
    layer = torch.nn.Linear(32, 48).to(torch.bfloat16).requires_grad_(False)
    plain = torch.nn.Linear(32, 48).to(torch.bfloat16).requires_grad_(False)
    plain.load_state_dict(layer.state_dict())
    _stored_forward(layer, torch.bfloat16, torch.device("cpu"))
    x1 = torch.randn(4, 32, dtype=torch.bfloat16, requires_grad=True)
    x2 = x1.detach().clone().requires_grad_(True)
    saved: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y1 = layer(x1)
    assert [t for t in saved if t.shape == (48, 32)] == [layer.weight]  # the stored weight itself, no copy
    y2 = plain(x2)
    assert torch.equal(y1, y2)
    y1.float().sum().backward()
    y2.float().sum().backward()
    assert torch.equal(x1.grad, x2.grad)
