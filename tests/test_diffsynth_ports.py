"""DiffSynth-Studio's FLUX.1-dev, FLUX.1 Kontext and Wan 2.1 LoRA commands as a DiffSynth user runs them, models at
DiffSynth's paths.

examples/flux/model_training/lora/FLUX.1-dev.sh names FLUX.1's release single files (`flux1-dev.safetensors`,
`ae.safetensors`, in Black Forest Labs' layout): they are read through the family's single-file formats
(models/release.py, families/flux/single_file.py), so the command runs verbatim but for the program name and
trains what the same command on the diffusers folders trains, bit for bit; FLUX.1-Kontext-dev.sh's Kontext DiT file
beside FLUX.1-dev's encoders trains `flux_kontext` with its reference images. examples/wanvideo/model_training/lora/
Wan2.1-T2V-1.3B.sh names the DiT in Wan's own layout and two pickles: one error line names all three and the
-Diffusers paths to give instead, and with those the command trains. Tiny models sit where DiffSynth downloads
(./models/<org>/<name>/...), written in the release layouts by tests/bfl_files.py; only sizes are lowered
(--dataset_repeat, the Wan clip size). No unitgraph variable is set: every model must be found locally.

The single-file hook itself: the header alone classifies a file and gives its config (the dry run opens no
tensor), a config beside it is read and hashed, the model loads in the requested dtype equal to diffusers' own
loading, and a file no format reads is named with the diffusers path of the same component.
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
diffusers = pytest.importorskip("diffusers")

from safetensors.torch import load_file, save_file  # noqa: E402

from bfl_files import write_bfl_autoencoder, write_bfl_transformer  # noqa: E402
from clitools import cli  # noqa: E402
from unitgraph.backends.diffusion.data.dataset import write_synthetic_dataset  # noqa: E402
from unitgraph.backends.diffusion.families import flux  # noqa: E402
from unitgraph.backends.diffusion.families.flux import tiny as flux_tiny  # noqa: E402
from unitgraph.backends.diffusion.models.folders import ModelLoadError  # noqa: E402
from unitgraph.backends.diffusion.models.hub import Hub  # noqa: E402
from unitgraph.backends.diffusion.models.sources import ModelSources  # noqa: E402

FLUX_REPO = Path("models") / "black-forest-labs" / "FLUX.1-dev"

# examples/flux/model_training/lora/FLUX.1-dev.sh; --dataset_repeat 50 lowered to 1
FLUX_COMMAND = """
  --dataset_base_path data/diffsynth_example_dataset/flux/FLUX.1-dev
  --dataset_metadata_path data/diffsynth_example_dataset/flux/FLUX.1-dev/metadata.csv
  --max_pixels 1048576
  --dataset_repeat 1
  --model_id_with_origin_paths "black-forest-labs/FLUX.1-dev:flux1-dev.safetensors,black-forest-labs/FLUX.1-dev:text_encoder/model.safetensors,black-forest-labs/FLUX.1-dev:text_encoder_2/*.safetensors,black-forest-labs/FLUX.1-dev:ae.safetensors"
  --learning_rate 1e-4
  --num_epochs 5
  --remove_prefix_in_ckpt "pipe.dit."
  --output_path "./models/train/FLUX.1-dev_lora"
  --lora_base_model "dit"
  --lora_target_modules "a_to_qkv,b_to_qkv,ff_a.0,ff_a.2,ff_b.0,ff_b.2,a_to_out,b_to_out,proj_out,norm.linear,norm1_a.linear,norm1_b.linear,to_qkv_mlp"
  --lora_rank 32
  --align_to_opensource_format
  --use_gradient_checkpointing
"""
FLUX_RELEASE_IDS = ("black-forest-labs/FLUX.1-dev:flux1-dev.safetensors,black-forest-labs/FLUX.1-dev:text_encoder/model.safetensors,"
                    "black-forest-labs/FLUX.1-dev:text_encoder_2/*.safetensors,black-forest-labs/FLUX.1-dev:ae.safetensors")
FLUX_DIFFUSERS_IDS = FLUX_RELEASE_IDS.replace(":flux1-dev.safetensors", ":transformer/*.safetensors").replace(
    ":ae.safetensors", ":vae/*.safetensors")

# examples/wanvideo/model_training/lora/Wan2.1-T2V-1.3B.sh; --dataset_repeat 100 lowered to 1, 480x832 to 32x32
WAN_COMMAND = """
  --dataset_base_path data/diffsynth_example_dataset/wanvideo/Wan2.1-T2V-1.3B
  --dataset_metadata_path data/diffsynth_example_dataset/wanvideo/Wan2.1-T2V-1.3B/metadata.csv
  --height 32
  --width 32
  --dataset_repeat 1
  --model_id_with_origin_paths "Wan-AI/Wan2.1-T2V-1.3B:diffusion_pytorch_model*.safetensors,Wan-AI/Wan2.1-T2V-1.3B:models_t5_umt5-xxl-enc-bf16.pth,Wan-AI/Wan2.1-T2V-1.3B:Wan2.1_VAE.pth"
  --learning_rate 1e-4
  --num_epochs 5
  --remove_prefix_in_ckpt "pipe.dit."
  --output_path "./models/train/Wan2.1-T2V-1.3B_lora"
  --lora_base_model "dit"
  --lora_target_modules "q,k,v,o,ffn.0,ffn.2"
  --lora_rank 32
"""
WAN_DIFFUSERS_IDS = ",".join(f"Wan-AI/Wan2.1-T2V-1.3B-Diffusers:{sub}/*.safetensors"
                             for sub in ("transformer", "text_encoder", "vae"))


# --------------------------------------------------------------------------------------------
# FLUX.1's release files at DiffSynth's paths


@pytest.fixture(scope="module")
def flux_models(tmp_path_factory) -> Path:
    """Tiny FLUX.1 components as a diffusers folder, its VAE with 32 groups of norms: the reference autoencoder's
    fixed count, which a release file without vae/config.json beside it is read with."""
    folder = flux_tiny.write_tiny_models(tmp_path_factory.mktemp("flux") / "diffusers", size="test", seed=0)
    config = dict(flux_tiny.SIZES["test"]["vae"], block_out_channels=[32, 32, 32, 32], norm_num_groups=32)
    torch.manual_seed(1)
    shutil.rmtree(folder / "vae")
    diffusers.AutoencoderKL(**config).save_pretrained(str(folder / "vae"))
    return folder


def flux_workdir(root: Path, models: Path, layout: str) -> Path:
    """A DiffSynth user's folder: black-forest-labs/FLUX.1-dev where DiffSynth downloads it (the release single
    files, or the diffusers transformer/ and vae/ folders), the text encoders and tokenizers, the example data."""
    repo = root / FLUX_REPO
    for sub in ("text_encoder", "text_encoder_2", "tokenizer", "tokenizer_2"):
        shutil.copytree(models / sub, repo / sub)
    if layout == "release":
        write_bfl_transformer(diffusers.FluxTransformer2DModel.from_pretrained(str(models / "transformer")),
                              repo / "flux1-dev.safetensors")
        write_bfl_autoencoder(diffusers.AutoencoderKL.from_pretrained(str(models / "vae")), repo / "ae.safetensors")
    else:
        for sub in ("transformer", "vae"):
            shutil.copytree(models / sub, repo / sub)
    write_synthetic_dataset(root / "data" / "diffsynth_example_dataset" / "flux" / "FLUX.1-dev", count=2, size=32, seed=1)
    return root


@pytest.fixture(scope="module")
def flux_release(flux_models, tmp_path_factory) -> Path:
    return flux_workdir(tmp_path_factory.mktemp("diffsynth-flux"), flux_models, "release")


def release_sources(root: Path, **kwargs) -> ModelSources:
    hub = Hub(base_path=root / "models", offline=True, offline_reason="test")
    return ModelSources(flux.FAMILY, hub=hub, offline=True, **kwargs)


def test_release_single_files_load_as_the_diffusers_modules(flux_models, flux_release, monkeypatch):
    sources = release_sources(flux_release, model_id_with_origin_paths=FLUX_RELEASE_IDS)
    repo = flux_release / FLUX_REPO
    dit, vae = sources.resolve("dit"), sources.resolve("vae_encoder")
    assert (dit.path, dit.class_name, vae.path, vae.class_name) == (
        repo / "flux1-dev.safetensors", "FluxTransformer2DModel", repo / "ae.safetensors", "AutoencoderKL")
    # the cache key's files: the single file itself
    assert sources.files("dit") == [repo / "flux1-dev.safetensors"] and sources.files("vae_encoder") == [repo / "ae.safetensors"]
    # the configuration from the header alone: no tensor is read
    import safetensors

    def no_tensors(*args, **kwargs):
        raise AssertionError("a tensor was read")

    with monkeypatch.context() as patched:
        patched.setattr(safetensors, "safe_open", no_tensors)
        config = sources.load_config("dit")
        vae_config = sources.load_config("vae_encoder")
    expected = diffusers.FluxTransformer2DModel.load_config(str(flux_models / "transformer"))
    for key in ("num_layers", "num_single_layers", "attention_head_dim", "num_attention_heads", "joint_attention_dim",
                "pooled_projection_dim", "guidance_embeds", "in_channels"):
        assert config[key] == expected[key], key
    assert list(config["axes_dims_rope"]) == list(expected["axes_dims_rope"])
    assert vae_config["norm_num_groups"] == 32 and list(vae_config["block_out_channels"]) == [32, 32, 32, 32]
    # loaded in the requested dtype, equal to diffusers' own loading of the same weights
    for dtype in (torch.bfloat16, torch.float32):
        loaded = sources.load(["dit", "vae_encoder"], torch_dtype=dtype)
        for slot, cls, sub in (("dit", diffusers.FluxTransformer2DModel, "transformer"),
                               ("vae_encoder", diffusers.AutoencoderKL, "vae")):
            reference = cls.from_pretrained(str(flux_models / sub), torch_dtype=dtype).state_dict()
            state = loaded[slot].state_dict()
            assert set(state) == set(reference), slot
            assert all(torch.equal(state[k], reference[k]) for k in state), slot
            assert {p.dtype for p in loaded[slot].parameters()} == {dtype} and not loaded[slot].training


def test_a_config_beside_the_file_is_read_and_hashed(flux_models, flux_release, tmp_path):
    repo = tmp_path / "FLUX.1-dev"
    shutil.copytree(flux_release / FLUX_REPO, repo)
    (repo / "transformer").mkdir()
    config = json.loads((flux_models / "transformer" / "config.json").read_text())
    (repo / "transformer" / "config.json").write_text(json.dumps({**config, "axes_dims_rope": [8, 4, 4]}))
    sources = ModelSources(flux.FAMILY, model_paths=str(repo / "flux1-dev.safetensors"))
    assert sources.files("dit") == sorted([repo / "flux1-dev.safetensors", repo / "transformer" / "config.json"])
    assert list(sources.load_config("dit")["axes_dims_rope"]) == [8, 4, 4]  # what the shapes cannot tell
    # a config beside that contradicts the file's shapes is one line naming the file
    (repo / "transformer" / "config.json").write_text(json.dumps({**config, "num_layers": 7}))
    with pytest.raises(ModelLoadError) as exc:
        ModelSources(flux.FAMILY, model_paths=str(repo / "flux1-dev.safetensors")).load_config("dit")
    assert "flux1-dev.safetensors" in str(exc.value) and "num_layers" in str(exc.value) and "\n" not in str(exc.value)


def test_files_it_cannot_read_are_one_line_naming_the_diffusers_paths(flux_models, tmp_path):
    """Release files that are not in a layout a format reads (here diffusers-named copies): each named once, and
    the diffusers path of its own component suggested (ae.safetensors -> vae/, not the DiT's transformer/)."""
    repo = tmp_path / FLUX_REPO
    repo.mkdir(parents=True)
    shutil.copy(flux_models / "transformer" / "diffusion_pytorch_model.safetensors", repo / "flux1-dev.safetensors")
    shutil.copy(flux_models / "vae" / "diffusion_pytorch_model.safetensors", repo / "ae.safetensors")
    (repo / "encoder.pth").write_bytes(b"never opened")
    with pytest.raises(ModelLoadError) as exc:
        release_sources(tmp_path, model_id_with_origin_paths=FLUX_RELEASE_IDS)
    line = str(exc.value)
    assert "\n" not in line and line.startswith("2 model files this command names cannot be read: ")
    assert "black-forest-labs/FLUX.1-dev:flux1-dev.safetensors (a single-file checkpoint" in line
    assert "black-forest-labs/FLUX.1-dev:ae.safetensors (a single-file checkpoint" in line
    assert "it is not a FLUX.1 DiT in Black Forest Labs' single-file layout nor " in line  # the layouts tried
    assert line.endswith(f'name the diffusers layout instead: --model_id_with_origin_paths "{FLUX_DIFFUSERS_IDS}"')
    # local files: a pickle is never opened; each is named with the diffusers folder of its component
    with pytest.raises(ModelLoadError) as exc:
        ModelSources(flux.FAMILY, model_paths=json.dumps([str(repo / "encoder.pth"), str(repo / "ae.safetensors")]))
    line = str(exc.value)
    assert f"{repo / 'encoder.pth'} (a pickle, which unitgraph never loads)" in line
    assert f"for {repo / 'ae.safetensors'} give its diffusers vae/ folder" in line


@pytest.mark.slow
def test_diffsynths_flux_lora_command_runs_verbatim_and_trains_what_the_diffusers_folders_train(
        flux_models, flux_release, tmp_path_factory, user_shell, monkeypatch):
    # bf16, as DiffSynth trains and as this test was made (a CPU without bf16 kernels defaults to fp32, where the two
    # layouts' runs agree only to rounding: not yet traced to the module that sums in another order)
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")
    done = user_shell.train(flux_release, FLUX_COMMAND)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "pipeline: flux (the model id black-forest-labs/FLUX.1-dev)" in done.stdout.splitlines()
    out = flux_release / "models" / "train" / "FLUX.1-dev_lora"
    assert sorted(p.name for p in out.glob("epoch-*.safetensors")) == [f"epoch-{k}.safetensors" for k in range(5)]
    # the same command on the diffusers folders of the same weights: the same LoRA, bit for bit
    other = flux_workdir(tmp_path_factory.mktemp("diffsynth-flux-diffusers"), flux_models, "diffusers")
    done = user_shell.train(other, FLUX_COMMAND.replace(FLUX_RELEASE_IDS, FLUX_DIFFUSERS_IDS))
    assert done.returncode == 0, done.stderr[-3000:]
    ours, theirs = (load_file(str(root / "models" / "train" / "FLUX.1-dev_lora" / "epoch-4.safetensors"))
                    for root in (flux_release, other))
    assert ours and set(ours) == set(theirs) and all(torch.equal(ours[k], theirs[k]) for k in ours)
    losses = [[row.split(",")[2] for row in (root / "models" / "train" / "FLUX.1-dev_lora" / "loss.csv")
               .read_text().splitlines()[1:]] for root in (flux_release, other)]
    assert losses[0] == losses[1] and len(losses[0]) == 10


def test_the_dry_run_of_the_flux_command_reads_headers_only(flux_release, monkeypatch, capsys):
    """`--dry_run` of the verbatim command: the single files' configs from their headers (no tensor is opened),
    the choice of pipeline first, as a run prints it."""
    import safetensors

    def no_tensors(*args, **kwargs):
        raise AssertionError("a tensor was read")

    monkeypatch.chdir(flux_release)
    monkeypatch.setattr(safetensors, "safe_open", no_tensors)
    code, out, err = cli(capsys, "train", *shlex.split(FLUX_COMMAND), "--dry_run")
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0] == "pipeline: flux (the model id black-forest-labs/FLUX.1-dev)"
    assert lines[1].startswith("memory plan: pipeline flux") and any(line.strip().startswith("dit ") for line in lines)
    code, out, err = cli(capsys, "train", *shlex.split(FLUX_COMMAND), "--dry_run", "--json")
    assert code == 0 and json.loads(out)["settings"]["pipeline_choice"] == lines[0]


# examples/flux/model_training/lora/FLUX.1-Kontext-dev.sh; --dataset_repeat 400 lowered to 1
KONTEXT_COMMAND = """
  --dataset_base_path data/diffsynth_example_dataset/flux/FLUX.1-Kontext-dev
  --dataset_metadata_path data/diffsynth_example_dataset/flux/FLUX.1-Kontext-dev/metadata.csv
  --data_file_keys "image,kontext_images"
  --max_pixels 1048576
  --dataset_repeat 1
  --model_id_with_origin_paths "black-forest-labs/FLUX.1-Kontext-dev:flux1-kontext-dev.safetensors,black-forest-labs/FLUX.1-dev:text_encoder/model.safetensors,black-forest-labs/FLUX.1-dev:text_encoder_2/*.safetensors,black-forest-labs/FLUX.1-dev:ae.safetensors"
  --learning_rate 1e-4
  --num_epochs 5
  --remove_prefix_in_ckpt "pipe.dit."
  --output_path "./models/train/FLUX.1-Kontext-dev_lora"
  --lora_base_model "dit"
  --lora_target_modules "a_to_qkv,b_to_qkv,ff_a.0,ff_a.2,ff_b.0,ff_b.2,a_to_out,b_to_out,proj_out,norm.linear,norm1_a.linear,norm1_b.linear,to_qkv_mlp"
  --lora_rank 32
  --align_to_opensource_format
  --extra_inputs "kontext_images"
  --use_gradient_checkpointing
"""


@pytest.mark.slow
def test_diffsynths_kontext_lora_command_runs_verbatim(flux_models, flux_release, tmp_path, user_shell):
    """The Kontext DiT's release file beside FLUX.1-dev's encoders and autoencoder (as the command names them), a
    dataset with reference images: the command chooses flux_kontext from the DiT's model id and trains."""
    root = tmp_path / "diffsynth-kontext"
    shutil.copytree(flux_release / FLUX_REPO, root / FLUX_REPO)
    kontext = root / "models" / "black-forest-labs" / "FLUX.1-Kontext-dev"
    kontext.mkdir(parents=True)
    shutil.copy(root / FLUX_REPO / "flux1-dev.safetensors", kontext / "flux1-kontext-dev.safetensors")
    write_synthetic_dataset(root / "data" / "diffsynth_example_dataset" / "flux" / "FLUX.1-Kontext-dev", count=2, size=32,
                            seed=4, images=["kontext_images"])
    done = user_shell.train(root, KONTEXT_COMMAND)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "pipeline: flux_kontext (the model id black-forest-labs/FLUX.1-Kontext-dev)" in done.stdout.splitlines()
    out = root / "models" / "train" / "FLUX.1-Kontext-dev_lora"
    assert sorted(p.name for p in out.glob("epoch-*.safetensors")) == [f"epoch-{k}.safetensors" for k in range(5)]
    rows = (out / "loss.csv").read_text().splitlines()[1:]
    assert len(rows) == 10 and all(float(row.split(",")[2]) > 0 for row in rows)


# --------------------------------------------------------------------------------------------
# Wan 2.1 T2V 1.3B: the release files are named in one line, the -Diffusers paths train


def wan_workdir(root: Path) -> Path:
    """Wan-AI/Wan2.1-T2V-1.3B as DiffSynth downloads it: the DiT in Wan's own layout (config.json of class
    WanModel beside its safetensors) and the text encoder and VAE as .pth pickles; the example videos."""
    repo = root / "models" / "Wan-AI" / "Wan2.1-T2V-1.3B"
    repo.mkdir(parents=True)
    (repo / "config.json").write_text(json.dumps({"_class_name": "WanModel", "dim": 16, "num_layers": 1}))
    save_file({"patch_embedding.weight": torch.zeros(16, 16, 1, 2, 2)}, str(repo / "diffusion_pytorch_model.safetensors"))
    for name in ("models_t5_umt5-xxl-enc-bf16.pth", "Wan2.1_VAE.pth"):
        (repo / name).write_bytes(b"\x80\x04 a pickle: never opened")
    write_synthetic_dataset(root / "data" / "diffsynth_example_dataset" / "wanvideo" / "Wan2.1-T2V-1.3B", count=2, size=32,
                            seed=2, videos=["video"], frames=9)
    return root


@pytest.mark.slow
def test_diffsynths_wan_command_names_every_unusable_file_in_one_line_then_trains_with_the_diffusers_paths(
        tmp_path, user_shell):
    pytest.importorskip("av")
    from unitgraph.backends.diffusion.families.wan import tiny as wan_tiny

    root = wan_workdir(tmp_path)
    done = user_shell.train(root, WAN_COMMAND)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1 and "Traceback" not in done.stderr, done.stderr[-3000:]
    line = lines[0]
    assert line.startswith("unitgraph: error: 3 model files this command names cannot be read: ")
    for item in ("Wan-AI/Wan2.1-T2V-1.3B:diffusion_pytorch_model*.safetensors (the dit in its release layout",
                 "Wan-AI/Wan2.1-T2V-1.3B:models_t5_umt5-xxl-enc-bf16.pth (a pickle, which unitgraph never loads)",
                 "Wan-AI/Wan2.1-T2V-1.3B:Wan2.1_VAE.pth (a pickle, which unitgraph never loads)"):
        assert item in line, item
    suggested = re.search(r'--model_id_with_origin_paths "([^"]+)"', line).group(1)
    assert suggested == WAN_DIFFUSERS_IDS  # folders of diffusers' WanPipeline, in the -Diffusers repository
    assert not (root / "models" / "train").exists()
    # the suggestion, with tiny models where DiffSynth would download Wan-AI/Wan2.1-T2V-1.3B-Diffusers
    wan_tiny.write_tiny_models(root / "models" / "Wan-AI" / "Wan2.1-T2V-1.3B-Diffusers", size="test", seed=0,
                               pipeline="wan")
    flags = WAN_COMMAND.replace(re.search(r'--model_id_with_origin_paths "([^"]+)"', WAN_COMMAND).group(1), suggested)
    done = user_shell.train(root, flags)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "pipeline: wan (the model id Wan-AI/Wan2.1-T2V-1.3B-Diffusers)" in done.stdout.splitlines()
    out = root / "models" / "train" / "Wan2.1-T2V-1.3B_lora"
    assert sorted(p.name for p in out.glob("epoch-*.safetensors")) == [f"epoch-{k}.safetensors" for k in range(5)]
    assert any(".attn1.to_q." in key for key in load_file(str(out / "epoch-4.safetensors")))
