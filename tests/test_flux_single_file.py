"""FLUX.1's release single files in Black Forest Labs' layout (flux1-dev.safetensors, ae.safetensors) read as
diffusers' FluxTransformer2DModel and AutoencoderKL (families/flux/single_file.py).

Tiny diffusers models are written in BFL's layout by an inverse mapping of their own (tests/bfl_files.py); the
reader must recognise each file, derive the config from its header alone, and convert it into a module equal
to the original bit for bit, in its weights and in its output. The DiT's file is also run through a plain
transcription of BFL's reference forward, and the autoencoder's converted by diffusers' own LDM converter, so
the layout itself is checked, not only the two mappings against each other. Bad files give one-line
ValueErrors; property tests cover random widths and depths, and damaged headers.
"""

from __future__ import annotations

import math
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
diffusers = pytest.importorskip("diffusers")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from safetensors import safe_open  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from bfl_files import (  # noqa: E402
    bfl_autoencoder_state, bfl_transformer_state, write_bfl_autoencoder, write_bfl_transformer)
from unitgraph.backends.diffusion.families.flux import single_file as sf  # noqa: E402
from unitgraph.backends.diffusion.families.flux.tiny import SIZES  # noqa: E402

F = torch.nn.functional

DITS = {
    "test": SIZES["test"]["transformer"],
    "demo": SIZES["demo"]["transformer"],
    "test-no-guidance": {**SIZES["test"]["transformer"], "guidance_embeds": False},
    "test-fill": {**SIZES["test"]["transformer"], "in_channels": 80, "out_channels": 64},  # FLUX.1 Fill's kind
}
VAES = {"test": SIZES["test"]["vae"], "demo": SIZES["demo"]["vae"]}
fast = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def randomized(module, seed: int):
    """The module with every parameter moved off its initial value (norm weights start as equal ones, which
    would hide two of them exchanged)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in module.parameters():
            parameter.add_(0.1 * torch.randn(parameter.shape, generator=generator))
    return module.eval()


def header_shapes(path) -> dict[str, tuple[int, ...]]:
    with safe_open(str(path), framework="pt") as f:
        return {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}


def structural(config, keys) -> dict:
    return {k: list(config[k]) if isinstance(config[k], (list, tuple)) else config[k] for k in keys}


def one_line_error(call, match: str) -> str:
    with pytest.raises(ValueError, match=match) as caught:
        call()
    message = str(caught.value)
    assert "\n" not in message and message.strip()
    return message


@pytest.fixture(scope="module", params=list(DITS))
def dit(request, tmp_path_factory):
    torch.manual_seed(0)
    model = randomized(diffusers.FluxTransformer2DModel(**DITS[request.param]), seed=1)
    path = write_bfl_transformer(model, tmp_path_factory.mktemp("bfl") / "flux1-dev.safetensors")
    return model, path


@pytest.fixture(scope="module", params=list(VAES))
def vae(request, tmp_path_factory):
    torch.manual_seed(0)
    model = randomized(diffusers.AutoencoderKL(**VAES[request.param]), seed=2)
    path = write_bfl_autoencoder(model, tmp_path_factory.mktemp("bfl") / "ae.safetensors")
    return model, path


@pytest.fixture(scope="module")
def test_dit_tensors():
    torch.manual_seed(0)
    return bfl_transformer_state(diffusers.FluxTransformer2DModel(**DITS["test"]))


def dit_inputs(config, seed: int = 3) -> dict:
    generator = torch.Generator().manual_seed(seed)
    rows, cols, text = 2, 3, 5
    img_ids = torch.zeros(rows * cols, 3)
    img_ids[:, 1] = torch.arange(rows).repeat_interleave(cols)
    img_ids[:, 2] = torch.arange(cols).repeat(rows)
    return {
        "hidden_states": torch.randn(1, rows * cols, config["in_channels"], generator=generator),
        "encoder_hidden_states": torch.randn(1, text, config["joint_attention_dim"], generator=generator),
        "pooled_projections": torch.randn(1, config["pooled_projection_dim"], generator=generator),
        "timestep": torch.tensor([0.7]),
        "img_ids": img_ids,
        "txt_ids": torch.zeros(text, 3),
        "guidance": torch.tensor([3.5]) if config["guidance_embeds"] else None,
    }


# ---- the DiT


def test_a_bfl_dit_file_becomes_the_diffusers_module_it_was(dit):
    original, path = dit
    shapes = header_shapes(path)
    assert sf.TRANSFORMER.matches(shapes) and not sf.AUTOENCODER.matches(shapes)

    config = sf.TRANSFORMER.config(shapes)
    keys = [k for k in config if k not in ("_class_name", "axes_dims_rope")]
    assert config["_class_name"] == "FluxTransformer2DModel"
    assert structural(config, keys) == structural(original.config, keys)
    assert sum(config["axes_dims_rope"]) == original.config.attention_head_dim

    # the repository's transformer/config.json beside the file gives the rotary split the weights cannot tell
    config = sf.TRANSFORMER.config(shapes, beside=dict(original.config))
    assert structural(config, list(config)[1:]) == structural(original.config, list(config)[1:])

    converted = diffusers.FluxTransformer2DModel.from_config(config).eval()
    converted.load_state_dict(sf.TRANSFORMER.convert(load_file(str(path))), strict=True)
    theirs, ours = original.state_dict(), converted.state_dict()
    assert list(theirs) == list(ours) and all(torch.equal(theirs[k], ours[k]) for k in theirs)
    inputs = dit_inputs(original.config)
    with torch.no_grad():
        assert torch.equal(original(**inputs).sample, converted(**inputs).sample)


def test_the_released_rotary_split_and_its_scaled_kin():
    assert sf.rope_axes(128) == [16, 56, 56]  # FLUX.1's, from its head size
    assert sf.rope_axes(16) == [4, 6, 6]  # the tiny test DiT's
    for head_dim in (2, 4, 7, 33):
        one_line_error(lambda: sf.rope_axes(head_dim), "no split")


@given(st.integers(3, 400))
@fast
def test_any_even_head_splits_into_three_even_rotary_axes(head_dim):
    try:
        axes = sf.rope_axes(head_dim)
    except ValueError:
        assert head_dim % 2 or head_dim < 6
        return
    assert sum(axes) == head_dim and all(n > 0 and n % 2 == 0 for n in axes) and axes[1] == axes[2]
    # FLUX.1's proportion (16 of 128): the first axis is the valid split's nearest an eighth of the head (a head of
    # 12 allows 4 or 8 only, 2.5 from its eighth)
    valid = [f for f in range(2, head_dim - 3, 2) if (head_dim - f) % 4 == 0]
    assert abs(axes[0] - head_dim / 8) == min(abs(f - head_dim / 8) for f in valid)


def bfl_reference_forward(w, heads, axes, img, img_ids, txt, txt_ids, t, y, guidance=None):
    """BFL's Flux.forward (flux/model.py, flux/modules/layers.py, flux/math.py) transcribed in plain torch,
    on a BFL state dict: the layout's meaning, independent of diffusers' modules."""
    def lin(x, name):
        return F.linear(x, w[f"{name}.weight"], w[f"{name}.bias"])

    def mlp_embedder(x, name):
        return lin(F.silu(lin(x, f"{name}.in_layer")), f"{name}.out_layer")

    def timestep_embedding(v, dim=256):
        freqs = torch.exp(-math.log(10000) * torch.arange(dim // 2, dtype=torch.float32) / (dim // 2))
        args = (1000.0 * v)[:, None].float() * freqs[None]
        return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)

    def rope(pos, dim):
        omega = 1.0 / 10000 ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
        out = pos.double()[..., None] * omega
        return torch.stack([out.cos(), -out.sin(), out.sin(), out.cos()], dim=-1).reshape(*out.shape, 2, 2).float()

    ids = torch.cat((txt_ids, img_ids), dim=1)
    pe = torch.cat([rope(ids[..., i], axes[i]) for i in range(3)], dim=-3).unsqueeze(1)

    def rotate(x):
        pairs = x.float().reshape(*x.shape[:-1], -1, 1, 2)
        return (pe[..., 0] * pairs[..., 0] + pe[..., 1] * pairs[..., 1]).reshape(*x.shape).type_as(x)

    def attention(q, k, v):
        return F.scaled_dot_product_attention(rotate(q), rotate(k), v).permute(0, 2, 1, 3).flatten(2)

    def rms_norm(x, name):
        return (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype) * w[name]

    def split_heads(qkv):  # B L (K H D) -> K B H L D
        return qkv.reshape(*qkv.shape[:2], 3, heads, -1).permute(2, 0, 3, 1, 4)

    def norm(x):
        return F.layer_norm(x, x.shape[-1:], eps=1e-6)

    def modulation(name, n):
        return lin(F.silu(vec), name)[:, None, :].chunk(n, dim=-1)

    img, txt = lin(img, "img_in"), lin(txt, "txt_in")
    vec = mlp_embedder(timestep_embedding(t), "time_in")
    if guidance is not None:
        vec = vec + mlp_embedder(timestep_embedding(guidance), "guidance_in")
    vec = vec + mlp_embedder(y, "vector_in")
    count = lambda prefix: len({k.split(".")[1] for k in w if k.startswith(prefix + ".")})  # noqa: E731
    for i in range(count("double_blocks")):
        b, prepared = f"double_blocks.{i}", {}
        for s, x in (("img", img), ("txt", txt)):
            shift1, scale1, gate1, shift2, scale2, gate2 = modulation(f"{b}.{s}_mod.lin", 6)
            q, k, v = split_heads(lin((1 + scale1) * norm(x) + shift1, f"{b}.{s}_attn.qkv"))
            q = rms_norm(q, f"{b}.{s}_attn.norm.query_norm.scale").to(v)
            k = rms_norm(k, f"{b}.{s}_attn.norm.key_norm.scale").to(v)
            prepared[s] = (q, k, v, gate1, shift2, scale2, gate2)
        joint = attention(*(torch.cat((prepared["txt"][n], prepared["img"][n]), dim=2) for n in range(3)))
        outputs = {"txt": joint[:, : txt.shape[1]], "img": joint[:, txt.shape[1]:]}
        streams = {"img": img, "txt": txt}
        for s, x in streams.items():
            gate1, shift2, scale2, gate2 = prepared[s][3:]
            x = x + gate1 * lin(outputs[s], f"{b}.{s}_attn.proj")
            hidden = F.gelu(lin((1 + scale2) * norm(x) + shift2, f"{b}.{s}_mlp.0"), approximate="tanh")
            streams[s] = x + gate2 * lin(hidden, f"{b}.{s}_mlp.2")
        img, txt = streams["img"], streams["txt"]
    x = torch.cat((txt, img), dim=1)
    width = x.shape[-1]
    for i in range(count("single_blocks")):
        b = f"single_blocks.{i}"
        shift, scale, gate = modulation(f"{b}.modulation.lin", 3)
        fused = lin((1 + scale) * norm(x) + shift, f"{b}.linear1")
        qkv, mlp = fused.split([3 * width, fused.shape[-1] - 3 * width], dim=-1)
        q, k, v = split_heads(qkv)
        q, k = rms_norm(q, f"{b}.norm.query_norm.scale").to(v), rms_norm(k, f"{b}.norm.key_norm.scale").to(v)
        out = lin(torch.cat((attention(q, k, v), F.gelu(mlp, approximate="tanh")), dim=2), f"{b}.linear2")
        x = x + gate * out
    img = x[:, txt.shape[1]:]
    shift, scale = lin(F.silu(vec), "final_layer.adaLN_modulation.1").chunk(2, dim=1)
    return lin((1 + scale[:, None, :]) * norm(img) + shift[:, None, :], "final_layer.linear")


@pytest.mark.parametrize("name", ["test", "test-no-guidance"])
def test_the_converted_dit_computes_what_bfls_reference_computes(name, tmp_path):
    torch.manual_seed(0)
    original = randomized(diffusers.FluxTransformer2DModel(**DITS[name]), seed=4)
    tensors = load_file(str(write_bfl_transformer(original, tmp_path / "flux1-dev.safetensors")))
    config = sf.TRANSFORMER.config({k: t.shape for k, t in tensors.items()}, beside=dict(original.config))
    model = diffusers.FluxTransformer2DModel.from_config(config).eval()
    model.load_state_dict(sf.TRANSFORMER.convert(tensors), strict=True)
    inputs = dit_inputs(config)
    with torch.no_grad():
        ours = model(**inputs).sample
        reference = bfl_reference_forward(
            tensors, config["num_attention_heads"], config["axes_dims_rope"], inputs["hidden_states"],
            inputs["img_ids"][None], inputs["encoder_hidden_states"], inputs["txt_ids"][None], inputs["timestep"],
            inputs["pooled_projections"], inputs["guidance"])
    assert ours.abs().max() > 0.1  # the comparison compares something
    torch.testing.assert_close(ours, reference, rtol=1e-4, atol=1e-5)


def test_converting_splits_and_reshapes_without_copies(test_dit_tensors):
    converted = sf.TRANSFORMER.convert(test_dit_tensors)
    storages = {t.untyped_storage().data_ptr() for t in test_dit_tensors.values()}
    copied = sorted(k for k, t in converted.items() if t.untyped_storage().data_ptr() not in storages)
    assert copied == ["norm_out.linear.bias", "norm_out.linear.weight"]  # the halves exchanged
    assert sum(t.numel() for t in converted.values()) == sum(t.numel() for t in test_dit_tensors.values())


@given(heads=st.integers(1, 3), head_dim=st.sampled_from([6, 8, 10, 16]), layers=st.integers(0, 2),
       single_layers=st.integers(0, 2), in_channels=st.integers(1, 12), out_channels=st.none() | st.integers(1, 12),
       joint=st.integers(1, 12), pooled=st.integers(1, 12), guidance=st.booleans())
@fast
def test_any_dit_shape_reads_back_as_its_config(heads, head_dim, layers, single_layers, in_channels, out_channels,
                                                joint, pooled, guidance):
    if layers + single_layers == 0:
        return
    config = {"patch_size": 1, "in_channels": in_channels, "out_channels": out_channels, "num_layers": layers,
              "num_single_layers": single_layers, "attention_head_dim": head_dim, "num_attention_heads": heads,
              "joint_attention_dim": joint, "pooled_projection_dim": pooled, "guidance_embeds": guidance,
              "axes_dims_rope": sf.rope_axes(head_dim)}
    with torch.device("meta"):
        model = diffusers.FluxTransformer2DModel(**config)
    tensors = bfl_transformer_state(model)
    shapes = {k: t.shape for k, t in tensors.items()}
    assert sf.TRANSFORMER.matches(shapes) and not sf.AUTOENCODER.matches(shapes)
    derived = sf.TRANSFORMER.config(shapes)
    expected_out = None if out_channels in (None, in_channels) else out_channels
    assert derived == {"_class_name": "FluxTransformer2DModel", **config, "out_channels": expected_out}
    converted = sf.TRANSFORMER.convert(tensors)
    assert {k: t.shape for k, t in converted.items()} == {k: t.shape for k, t in model.state_dict().items()}


def meta_like(shapes):
    return {name: torch.empty(shape, device="meta") for name, shape in shapes.items()}


@given(data=st.data())
@fast
def test_a_damaged_dit_header_is_refused_in_one_line_or_read_consistently(test_dit_tensors, data):
    shapes = {k: tuple(t.shape) for k, t in test_dit_tensors.items()}
    name = data.draw(st.sampled_from(sorted(shapes)))
    damage = data.draw(st.sampled_from(["drop", "resize", "add", "renumber"]))
    if damage == "drop":
        del shapes[name]
    elif damage == "resize":
        dim = data.draw(st.integers(0, len(shapes[name]) - 1))
        shapes[name] = tuple(data.draw(st.integers(1, 300)) if i == dim else n for i, n in enumerate(shapes[name]))
    elif damage == "add":
        shapes[name + "_extra"] = (4,)
    else:
        shapes["single_blocks.%d.linear1.weight" % data.draw(st.integers(1, 10**9))] = (4, 4)
    assert sf.TRANSFORMER.matches(shapes) in (True, False)
    try:
        config = sf.TRANSFORMER.config(shapes)
        converted = sf.TRANSFORMER.convert(meta_like(shapes))
    except ValueError as error:
        assert "\n" not in str(error)
        return
    with torch.device("meta"):
        model = diffusers.FluxTransformer2DModel.from_config(config)
    assert {k: t.shape for k, t in converted.items()} == {k: t.shape for k, t in model.state_dict().items()}


def test_a_truncated_or_misshapen_dit_file_is_refused_in_one_line(test_dit_tensors):
    tensors = dict(test_dit_tensors)
    del tensors["single_blocks.0.linear1.bias"]
    one_line_error(lambda: sf.TRANSFORMER.convert(tensors), r"1 tensor missing \(single_blocks.0.linear1.bias\)")

    truncated = {k: t for k, t in test_dit_tensors.items() if not k.startswith("double_blocks.0.txt")}
    message = one_line_error(lambda: sf.TRANSFORMER.convert(truncated), "missing")
    assert "12 tensors missing" in message and "and 9 more" in message

    tensors = {**test_dit_tensors, "single_blocks.0.linear2.weight": torch.zeros(32, 161)}
    one_line_error(lambda: sf.TRANSFORMER.convert(tensors), r"linear2.weight is \[32, 161\], expected \[32, 160\]")

    # an MLP of another width than diffusers' fixed 4 x hidden cannot be represented
    tensors = {**test_dit_tensors, "double_blocks.0.img_mlp.0.weight": torch.zeros(96, 32),
               "double_blocks.0.img_mlp.0.bias": torch.zeros(96)}
    one_line_error(lambda: sf.TRANSFORMER.convert(tensors), "inconsistent shapes")

    tensors = {**test_dit_tensors, "model.diffusion_model.img_in.weight": torch.zeros(1)}
    one_line_error(lambda: sf.TRANSFORMER.convert(tensors), "1 tensor unexpected")

    tensors = {k.replace("double_blocks.0.", "double_blocks.1."): t for k, t in test_dit_tensors.items()}
    one_line_error(lambda: sf.TRANSFORMER.config({k: t.shape for k, t in tensors.items()}),
                   "double_blocks is numbered up to 1 but has no double_blocks.0")

    no_blocks = {k: t.shape for k, t in test_dit_tensors.items() if "_blocks." not in k}
    one_line_error(lambda: sf.TRANSFORMER.config(no_blocks), "head size cannot be told")


def test_a_config_beside_the_dit_must_describe_it(test_dit_tensors):
    shapes = {k: t.shape for k, t in test_dit_tensors.items()}
    one_line_error(lambda: sf.TRANSFORMER.config(shapes, beside={"num_layers": 19, "axes_dims_rope": [4, 6, 6]}),
                   "num_layers=19")
    one_line_error(lambda: sf.TRANSFORMER.config(shapes, beside={"axes_dims_rope": [16, 56, 56]}), "axes_dims_rope")
    one_line_error(lambda: sf.TRANSFORMER.config(shapes, beside={"_class_name": "AutoencoderKL"}), "AutoencoderKL")
    # diffusers writes out_channels null for "as many as in"; the released config leaves out what it does not set
    config = sf.TRANSFORMER.config(shapes, beside={"_class_name": "FluxTransformer2DModel", "out_channels": None,
                                                   "in_channels": 64, "axes_dims_rope": [2, 8, 6]})
    assert config["axes_dims_rope"] == [2, 8, 6] and config["out_channels"] is None


# ---- the autoencoder


def test_a_bfl_autoencoder_file_becomes_the_diffusers_module_it_was(vae):
    original, path = vae
    shapes = header_shapes(path)
    assert sf.AUTOENCODER.matches(shapes) and not sf.TRANSFORMER.matches(shapes)

    # GroupNorm's group count leaves no trace in the weights: without a config beside the file it is the
    # reference code's 32, refused where it does not divide the channels (the test VAE's 8)
    groups = original.config.norm_num_groups
    if any(c % 32 for c in original.config.block_out_channels):
        one_line_error(lambda: sf.AUTOENCODER.config(shapes), "norm_num_groups=32")
    else:
        assert sf.AUTOENCODER.config(shapes)["norm_num_groups"] == 32 != groups  # the demo VAE's 16: unknowable
    config = sf.AUTOENCODER.config(shapes, beside={"norm_num_groups": groups})
    assert config["scaling_factor"] == 0.3611 and config["shift_factor"] == 0.1159  # FLUX.1's, by default
    config = sf.AUTOENCODER.config(shapes, beside=dict(original.config))
    keys = [k for k in config if k != "_class_name"]
    assert config["_class_name"] == "AutoencoderKL"
    assert structural(config, keys) == structural(original.config, keys)

    converted = diffusers.AutoencoderKL.from_config(config).eval()
    tensors = load_file(str(path))
    state = sf.AUTOENCODER.convert(tensors)
    converted.load_state_dict(state, strict=True)
    theirs, ours = original.state_dict(), converted.state_dict()
    assert list(theirs) == list(ours) and all(torch.equal(theirs[k], ours[k]) for k in theirs)
    image = torch.randn(1, 3, 32, 32, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        assert torch.equal(original(image).sample, converted(image).sample)

    # diffusers' own converter of LDM autoencoders reads the layout the same way
    from diffusers.loaders import single_file_utils

    theirs = single_file_utils.convert_ldm_vae_checkpoint(dict(tensors), dict(config))
    assert sorted(theirs) == sorted(state) and all(torch.equal(theirs[k], state[k]) for k in state)


def test_the_attention_convolutions_become_linear_views(vae):
    _, path = vae
    tensors = load_file(str(path))
    converted = sf.AUTOENCODER.convert(tensors)
    weight = converted["decoder.mid_block.attentions.0.to_q.weight"]
    assert weight.ndim == 2
    assert weight.data_ptr() == tensors["decoder.mid.attn_1.q.weight"].data_ptr()
    storages = {t.untyped_storage().data_ptr() for t in tensors.values()}
    assert all(t.untyped_storage().data_ptr() in storages for t in converted.values())


@given(levels=st.integers(1, 3), layers=st.integers(1, 2), groups=st.sampled_from([1, 2, 4]), data=st.data(),
       latent=st.integers(1, 8), in_channels=st.integers(1, 4), out_channels=st.integers(1, 4),
       attention=st.booleans())
@fast
def test_any_autoencoder_shape_reads_back_as_its_config(levels, layers, groups, data, latent, in_channels,
                                                        out_channels, attention):
    channels = [groups * data.draw(st.integers(1, 3)) for _ in range(levels)]
    config = {"in_channels": in_channels, "out_channels": out_channels,
              "down_block_types": ["DownEncoderBlock2D"] * levels, "up_block_types": ["UpDecoderBlock2D"] * levels,
              "block_out_channels": channels, "layers_per_block": layers, "act_fn": "silu",
              "latent_channels": latent, "use_quant_conv": False, "use_post_quant_conv": False,
              "mid_block_add_attention": attention}
    extras = {"norm_num_groups": groups, "sample_size": 64, "scaling_factor": 0.5, "shift_factor": None,
              "force_upcast": False}
    with torch.device("meta"):
        model = diffusers.AutoencoderKL(**config, **extras)
    tensors = bfl_autoencoder_state(model)
    shapes = {k: t.shape for k, t in tensors.items()}
    assert sf.AUTOENCODER.matches(shapes) and not sf.TRANSFORMER.matches(shapes)
    assert sf.AUTOENCODER.config(shapes, beside=extras) == {"_class_name": "AutoencoderKL", **config, **extras}
    converted = sf.AUTOENCODER.convert(tensors)
    assert {k: t.shape for k, t in converted.items()} == {k: t.shape for k, t in model.state_dict().items()}


def test_a_truncated_or_misshapen_autoencoder_file_is_refused_in_one_line(vae):
    original, path = vae
    tensors = load_file(str(path))
    truncated = {k: t for k, t in tensors.items() if not k.startswith("decoder.up.0.")}
    one_line_error(lambda: sf.AUTOENCODER.convert(truncated), "tensors missing")

    misshapen = {**tensors, "encoder.conv_out.weight": tensors["encoder.conv_out.weight"][:16]}  # no log-variance
    one_line_error(lambda: sf.AUTOENCODER.convert(misshapen), r"encoder.conv_out.weight is \[16, ")

    sd_like = {**tensors, "quant_conv.weight": torch.zeros(32, 32, 1, 1), "quant_conv.bias": torch.zeros(32)}
    one_line_error(lambda: sf.AUTOENCODER.convert(sd_like),
                   r"2 tensors unexpected \(quant_conv.bias, quant_conv.weight\)")

    shapes = {k: t.shape for k, t in tensors.items()}
    one_line_error(lambda: sf.AUTOENCODER.config(shapes, beside={"block_out_channels": [128, 256, 512, 512]}),
                   "block_out_channels")
    one_line_error(lambda: sf.AUTOENCODER.config(shapes, beside={"norm_num_groups": 3}), "norm_num_groups=3")


def test_an_autoencoder_of_another_latent_width_needs_its_scaling_beside():
    with torch.device("meta"):
        model = diffusers.AutoencoderKL(**{**VAES["test"], "latent_channels": 4})
    shapes = {k: t.shape for k, t in bfl_autoencoder_state(model).items()}
    one_line_error(lambda: sf.AUTOENCODER.config(shapes, beside={"norm_num_groups": 4}), "4 latent channels")
    config = sf.AUTOENCODER.config(shapes, beside={"norm_num_groups": 4, "scaling_factor": 0.18215,
                                                   "shift_factor": None})
    assert config["scaling_factor"] == 0.18215 and config["shift_factor"] is None


# ---- the two formats together


def test_neither_format_takes_a_diffusers_layout_file():
    with torch.device("meta"):
        dit = diffusers.FluxTransformer2DModel(**DITS["test"])
        vae = diffusers.AutoencoderKL(**VAES["test"])
    for module in (dit, vae):
        shapes = {k: t.shape for k, t in module.state_dict().items()}
        assert not sf.TRANSFORMER.matches(shapes) and not sf.AUTOENCODER.matches(shapes)
    assert not sf.TRANSFORMER.matches({}) and not sf.AUTOENCODER.matches({})


def test_the_formats_interface():
    for fmt, class_name in ((sf.TRANSFORMER, "FluxTransformer2DModel"), (sf.AUTOENCODER, "AutoencoderKL")):
        assert fmt.class_name == class_name and fmt.description.startswith("a FLUX.1 ")
        assert isinstance(fmt, sf.SingleFileFormat)


def test_the_module_imports_no_torch():
    code = ("import sys; import unitgraph.backends.diffusion.families.flux.single_file; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True)
