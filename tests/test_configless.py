"""DiffSynth's `./models` as its download leaves it: component folders of weights without config.json, completed
from the family's released configs (backends/diffusion/models/configless.py).

The released models are tens of GB; their safetensors files are written here as DiffSynth's download names them,
with the released shapes in their headers and sparse data (a file of the right size that holds no blocks on disk):
choosing a config reads the headers only. Training through a completed folder is tested on the tiny models, whose
config stands in for a release's.
"""

from __future__ import annotations

import csv
import json
import os
import shutil
import struct
from pathlib import Path

import pytest

from clitools import cli

torch = pytest.importorskip("torch")

QWEN_IDS = ("Qwen/Qwen-Image:transformer/diffusion_pytorch_model*.safetensors,"
            "Qwen/Qwen-Image:text_encoder/model*.safetensors,Qwen/Qwen-Image:vae/diffusion_pytorch_model.safetensors")


def losses(folder: Path) -> list[str]:
    with (folder / "loss.csv").open() as handle:
        return [row["loss"] for row in csv.DictReader(handle)]


def sparse_safetensors(path: Path, shapes: dict[str, tuple[int, ...]], dtype: str = "BF16") -> None:
    """A safetensors file with these tensors in its header and sparse data (nothing written but the header)."""
    offset, tensors = 0, {}
    for name, shape in shapes.items():
        size = 2
        for dim in shape:
            size *= dim
        tensors[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    head = json.dumps(tensors).encode()
    head += b" " * (-len(head) % 8)
    with path.open("wb") as handle:
        handle.write(struct.pack("<Q", len(head)) + head)
        handle.truncate(8 + len(head) + offset)


def released_state(folder: Path, library: str, class_name: str) -> dict[str, tuple[int, ...]]:
    """{name: shape} of the state dict of the model a released config.json describes, built by its library."""
    from accelerate import init_empty_weights

    with init_empty_weights():
        if library == "diffusers":
            import diffusers

            cls = getattr(diffusers, class_name)
            model = cls.from_config(cls.load_config(str(folder)))
        else:
            import transformers

            model = getattr(transformers, class_name)._from_config(transformers.AutoConfig.from_pretrained(str(folder)))
    return {name: tuple(value.shape) for name, value in model.state_dict().items()}


def shards(folder: Path, stem: str, state: dict[str, tuple[int, ...]], count: int) -> None:
    """The state's tensors in `count` files named as the release names its shards (`stem-0000i-of-0000n`)."""
    folder.mkdir(parents=True)
    names = list(state)
    for i in range(count):
        part = {name: state[name] for name in names[i::count]}
        name = f"{stem}-{i + 1:05d}-of-{count:05d}.safetensors" if count > 1 else f"{stem}.safetensors"
        sparse_safetensors(folder / name, part)


@pytest.fixture(scope="module")
def diffsynth_models(tmp_path_factory, tiny):
    """DiffSynth's ./models/Qwen/Qwen-Image after its download of QWEN_IDS and the tokenizer: the weights the
    patterns name at the released shapes (sparse), no config.json, no shard index."""
    from unitgraph.backends.diffusion.families.qwen_image import real

    root = tmp_path_factory.mktemp("diffsynth")
    configs = real.write_real_configs(root / "configs")
    qwen = root / "models" / "Qwen" / "Qwen-Image"
    shards(qwen / "transformer", "diffusion_pytorch_model",
           released_state(configs / "transformer", "diffusers", "QwenImageTransformer2DModel"), 9)
    shards(qwen / "vae", "diffusion_pytorch_model",
           released_state(configs / "vae", "diffusers", "AutoencoderKLQwenImage"), 1)
    shards(qwen / "text_encoder", "model",
           released_state(configs / "text_encoder", "transformers", "Qwen2_5_VLForConditionalGeneration"), 4)
    shutil.copytree(tiny / "tokenizer", qwen / "tokenizer")
    return root


def sources_of(root: Path, ids: str):
    from unitgraph.backends.diffusion.families.qwen_image import FAMILY
    from unitgraph.backends.diffusion.models.hub import Hub
    from unitgraph.backends.diffusion.models.sources import ModelSources

    hub = Hub(base_path=root / "models", offline=True, offline_reason="DIFFSYNTH_SKIP_DOWNLOAD")
    return ModelSources(FAMILY, model_id_with_origin_paths=ids, offline=True, hub=hub)


def test_a_diffsynth_download_without_configs_is_read_with_the_released_configs(diffsynth_models):
    from unitgraph.backends.diffusion.families.qwen_image import real

    sources = sources_of(diffsynth_models, QWEN_IDS)
    assert sources.load_config("dit")["num_layers"] == real.TRANSFORMER["num_layers"] == 60
    assert sources.load_config("vae")["z_dim"] == real.VAE["z_dim"]
    assert sources.load_config("text_encoder").get_text_config().hidden_size == real.TEXT_ENCODER["hidden_size"]
    notes = [done.note for done in sources.completed]
    assert len(notes) == 3 and all("Qwen/Qwen-Image's released" in n for n in notes), notes
    user = diffsynth_models / "models" / "Qwen" / "Qwen-Image" / "transformer"
    assert sorted(p.name for p in user.iterdir()) == [f"diffusion_pytorch_model-{i:05d}-of-00009.safetensors"
                                                      for i in range(1, 10)]  # nothing written into the user's folder
    completed = sources.resolve("dit").path
    assert completed != user and (completed / "diffusion_pytorch_model.safetensors.index.json").is_file()
    index = json.loads((completed / "diffusion_pytorch_model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == {p.name for p in user.iterdir()}


def test_the_resolver_classifies_each_candidate_once_in_one_pass(diffsynth_models, monkeypatch):
    """Parse, list the candidates, classify each once, choose: resolving every slot of DiffSynth's command twice
    reads each model id's files once (the tokenizer, which no pattern names, from its origin beside them)."""
    from unitgraph.backends.diffusion.families.qwen_image import FAMILY
    from unitgraph.backends.diffusion.models import sources as sources_module
    from unitgraph.backends.diffusion.models.hub import Hub

    looked: list[tuple[str, str]] = []
    snapshot = Hub.snapshot

    def counted(self, model_id, pattern, error):
        looked.append((model_id, pattern))
        return snapshot(self, model_id, pattern, error)

    monkeypatch.setattr(Hub, "snapshot", counted)
    sources = sources_of(diffsynth_models, QWEN_IDS)
    assert [c.origin for c in sources.candidates] == QWEN_IDS.split(",") and all(c.remote for c in sources.candidates)
    slots = ["dit", "vae", "text_encoder", "tokenizer", "scheduler"]
    first = {slot: sources.resolve(slot).path for slot in slots}
    assert {slot: sources.resolve(slot).path for slot in slots} == first
    assert sorted(set(looked)) == sorted(looked), looked  # nothing looked up twice
    assert {c.origin for c in sources.candidates} <= {f"{m}:{p}" for m, p in looked}
    assert len(sources.entries) == 3 and sources_module.Candidate("x").subfolder == ""


def test_weights_that_fit_no_released_config_are_named_together_in_one_line(diffsynth_models, tmp_path):
    from unitgraph.backends.diffusion.models.folders import ModelLoadError

    root = tmp_path / "copy"
    shutil.copytree(diffsynth_models, root, symlinks=True, copy_function=os.link)  # sparse files: linked, not copied
    qwen = root / "models" / "Qwen" / "Qwen-Image"
    for sub in ("transformer", "vae"):  # a tensor fewer: another model than any release
        files = sorted((qwen / sub).glob("*.safetensors"))
        with files[0].open("rb") as handle:  # the header only: the data is sparse GBs
            head = json.loads(handle.read(struct.unpack("<Q", handle.read(8))[0]))
        state = {k: tuple(v["shape"]) for k, v in head.items()}
        state.pop(sorted(state)[0])
        files[0].unlink()
        sparse_safetensors(files[0], state)
    with pytest.raises(ModelLoadError) as caught:
        sources_of(root, QWEN_IDS)
    line = str(caught.value)
    assert "\n" not in line and "Qwen/Qwen-Image:transformer/" in line and "Qwen/Qwen-Image:vae/" in line
    assert "fit none of the released transformer configs of Qwen/Qwen-Image" in line
    assert "put the release's vae/config.json beside them" in line


def test_klein_text_encoder_without_config_is_completed_as_qwen3_not_as_flux2_devs_mistral(tmp_path):
    """FLUX.2 keeps two text-encoder classes in text_encoder/ (FLUX.2-dev's Mistral 3, klein's Qwen3): klein-4B's
    downloaded without its config.json is completed from klein's released config, each release's config read with
    the class it names (read with the family's first text-encoder class, Mistral 3, it was a traceback)."""
    from unitgraph.backends.diffusion.families.flux2 import FAMILY, real
    from unitgraph.backends.diffusion.models.hub import Hub
    from unitgraph.backends.diffusion.models.sources import ModelSources

    configs = real.write_real_configs(tmp_path / "configs", pipeline="flux2_klein")
    klein = tmp_path / "models" / "black-forest-labs" / "FLUX.2-klein-4B"
    shards(klein / "text_encoder", "model", released_state(configs / "text_encoder", "transformers",
                                                          "Qwen3ForCausalLM"), 2)
    ids = "black-forest-labs/FLUX.2-klein-4B:text_encoder/*.safetensors"
    hub = Hub(base_path=tmp_path / "models", offline=True, offline_reason="DIFFSYNTH_SKIP_DOWNLOAD")
    sources = ModelSources(FAMILY, model_id_with_origin_paths=ids, offline=True, hub=hub)
    assert sources.load_config("text_encoder_qwen3").hidden_size == real.TEXT_ENCODER["hidden_size"]
    assert [done.note for done in sources.completed][0].count("FLUX.2-klein-4B") >= 1


def test_a_completed_tiny_folder_trains_as_the_whole_folder(tiny, tmp_path, monkeypatch, capsys):
    """The tiny Qwen-Image DiT saved in 3 shards, then its config.json and shard index removed as DiffSynth's
    download leaves a folder; with the tiny config standing for a release, the run reads the completed folder and
    trains the very numbers of the whole folder."""
    from diffusers import QwenImageTransformer2DModel

    from unitgraph.backends.diffusion.data.dataset import write_synthetic_dataset
    from unitgraph.backends.diffusion.models import configless

    whole = tmp_path / "whole"
    shutil.copytree(tiny, whole)
    shutil.rmtree(whole / "transformer")
    QwenImageTransformer2DModel.from_pretrained(str(tiny / "transformer")).save_pretrained(
        str(whole / "transformer"), max_shard_size="40KB")
    assert len(list((whole / "transformer").glob("*.safetensors"))) > 1
    dit = tmp_path / "models" / "transformer"
    dit.parent.mkdir()
    shutil.copytree(whole / "transformer", dit)
    config = json.loads((dit / "config.json").read_text())
    (dit / "config.json").unlink()
    (dit / "diffusion_pytorch_model.safetensors.index.json").unlink()
    released = configless.released

    def with_tiny(family, subfolder):
        out = released(family, subfolder)
        if subfolder == "transformer":
            state = {k: tuple(v.shape) for k, v in QwenImageTransformer2DModel.from_config(config).state_dict().items()}
            out = [*out, ("the tiny test release", config, (state,))]
        return out

    monkeypatch.setattr(configless, "released", with_tiny)
    data = tmp_path / "data"
    write_synthetic_dataset(data, count=2, size=32, seed=3)
    common = ["train", "--dataset_base_path", str(data), "--dataset_metadata_path", str(data / "metadata.csv"),
              "--lora_base_model", "dit", "--max_pixels", "1024", "--seed", "2", "--no-progress", "--no-plot"]
    paths = json.dumps([str(p) for p in sorted(dit.glob("*.safetensors"))] + [str(tiny / s) for s in
                       ("text_encoder", "vae", "tokenizer", "scheduler")])
    code, out, err = cli(capsys, *common, "--model_paths", paths, "--output_path", str(tmp_path / "completed"))
    assert code == 0, err
    assert f"note: {dit} has weights without a config.json (as DiffSynth's download leaves it): read with the tiny " \
           "test release's released transformer config" in out
    code, _, err = cli(capsys, *common, "--model_paths", str(whole), "--output_path", str(tmp_path / "whole-run"))
    assert code == 0, err
    assert losses(tmp_path / "completed") == losses(tmp_path / "whole-run") and losses(tmp_path / "completed")
    assert sorted(p.name for p in dit.iterdir()) == sorted(p.name for p in (whole / "transformer").glob("*.safetensors"))
