"""Choosing a family: --pipeline, model_index.json, `unitgraph pipelines`, `tiny-models --pipeline`; LoRA errors.

The conformance suite (test_conformance.py) checks what every family does; this file checks how a
run finds its family and what the commands around families print.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from clitools import cli
from unitgraph.backends.diffusion import registry
from unitgraph.backends.diffusion.errors import BackendError
from unitgraph.backends.diffusion.args import make_args

REPO = Path(__file__).resolve().parents[1]


RELEASE_FILE = re.compile(r"[\w./:*-]+\.(?:safetensors|pth)\b")


def test_nothing_outside_a_family_folder_names_the_family():
    """`grep -ril <family> backends/` finds the family's folder and its registry line only."""
    for family in registry.families():
        # the name (or its underscore-less spelling) in any case, not inside a longer lowercase word: "Wan" and
        # "WanPipeline" count, "wanted" and "wandb" do not
        names = f"{re.escape(family.name)}|{re.escape(family.name.replace('_', ''))}"
        pattern = re.compile(rf"(?<![A-Za-z])(?i:{names})(?![a-z])")
        # a release's file name is not code about the family (Anima ships its VAE as qwen_image_vae.safetensors)
        found = [str(f) for f in (REPO / "backends").rglob("*.py")
                 if pattern.search(RELEASE_FILE.sub("", f.read_text(encoding="utf-8")))]
        # a family whose name extends this one's (flux2 after flux: FLUX.2 is FLUX's next line) names it in its own folder
        heirs = [f.name for f in registry.families() if f.name.startswith(family.name)]
        outside = {f for f in found if not any(f"/families/{name}/" in f for name in heirs)}
        assert outside <= {str(REPO / "backends" / "diffusion" / "registry.py")}, outside
        registry_text = (REPO / "backends" / "diffusion" / "registry.py").read_text()
        assert len(re.findall(rf"\b{re.escape(family.name)}\b", registry_text.lower())) == 1


def test_pipeline_choice(tmp_path):
    from unitgraph.backends.diffusion.config import choose_pipeline

    first = registry.default_family()
    # nothing decides: the first registered family, its pipeline for the task
    family, pipeline = choose_pipeline(make_args(lora_base_model="dit"))
    assert family is first and pipeline.task == "sft"
    assert choose_pipeline(make_args(task="direct_distill", lora_base_model="dit"))[1].task == "direct_distill"
    # --pipeline: a pipeline of its task, or its family's pipeline for another task
    for fam in registry.families():
        for p in fam.pipelines:
            assert choose_pipeline(make_args(pipeline=p.name, task=p.task, lora_base_model="dit"))[1] is p
            assert choose_pipeline(make_args(pipeline=fam.name, task=p.task, lora_base_model="dit"))[0] is fam
    with pytest.raises(BackendError, match="unknown pipeline 'nope'"):
        choose_pipeline(make_args(pipeline="nope", lora_base_model="dit"))
    # model_index.json names the family's diffusers pipeline class
    for fam in registry.families():
        folder = tmp_path / fam.name
        folder.mkdir()
        (folder / "model_index.json").write_text(json.dumps({"_class_name": fam.diffusers_pipelines[0]}))
        assert choose_pipeline(make_args(model_paths=str(folder), lora_base_model="dit"))[0] is fam
    for fam in registry.families():  # a class of one pipeline's own (e.g. an edit pipeline) selects that pipeline;
        for p in fam.pipelines:      # of several (FLUX.2's, with and without edit images), the first without data
            if p.diffusers_pipeline:
                folder = tmp_path / f"own-{p.name}"
                folder.mkdir()
                (folder / "model_index.json").write_text(json.dumps({"_class_name": p.diffusers_pipeline}))
                sharing = [q for q in fam.pipelines if q.task == p.task and fam.diffusers_class(q) == p.diffusers_pipeline]
                chosen = choose_pipeline(make_args(model_paths=str(folder), task=p.task, lora_base_model="dit"))[1]
                assert chosen is sharing[0]
    unknown = tmp_path / "other"
    unknown.mkdir()
    (unknown / "model_index.json").write_text(json.dumps({"_class_name": "SomeOtherPipeline"}))
    # a class no family loads is said in one line (untrained.py), not taken for the first family
    with pytest.raises(BackendError, match="names the diffusers class SomeOtherPipeline, which no family of unitgraph"):
        choose_pipeline(make_args(model_paths=str(unknown), lora_base_model="dit"))
    assert choose_pipeline(make_args(model_paths=str(tmp_path / "nothing-here"), lora_base_model="dit"))[0] is first


def test_lora_base_model_must_be_a_model_of_the_pipeline():
    from unitgraph.backends.diffusion.config import RunConfig

    with pytest.raises(BackendError, match="--lora_base_model 'unet' is not a model of pipeline"):
        RunConfig.from_args(make_args(lora_base_model="unet"))
    cfg = RunConfig.from_args(make_args(lora_base_model="text_encoder"))
    assert cfg.lora.targets == cfg.family.slot("text_encoder").lora_targets  # the family's default targets
    cfg = RunConfig.from_args(make_args(lora_base_model="dit", lora_target_modules="to_q,to_k"))
    assert cfg.lora.targets == ("to_q", "to_k")


def test_pipelines_command(capsys):
    code, out, err = cli(capsys, "pipelines", "--json")
    assert code == 0, err
    rows = json.loads(out)
    assert [r["family"] for r in rows] == [f.name for f in registry.families()]
    qwen = rows[0]
    tasks = {p["name"]: p["task"] for p in qwen["pipelines"]}
    assert tasks == {p.name: p.task for p in registry.family("qwen_image").pipelines}
    assert tasks["qwen_image"] == "sft" and tasks["qwen_image_distill"] == "direct_distill"
    assert {s["name"] for s in qwen["slots"]} >= {"dit", "vae", "text_encoder", "tokenizer", "scheduler"}
    code, out, _ = cli(capsys, "pipelines")
    assert code == 0 and "qwen_image_distill" in out and "QwenImageTransformer2DModel" in out


def test_tiny_models_and_train_refuse_unknown_pipelines_in_one_line(capsys, tmp_path):
    for argv in (("tiny-models", str(tmp_path / "m"), "--pipeline", "nope"),
                 ("train", "--pipeline", "nope", "--lora_base_model", "dit", "--dataset_base_path", str(tmp_path))):
        code, out, err = cli(capsys, *argv)
        assert code == 2 and err.count("\n") == 1 and "unknown pipeline 'nope'" in err and "Traceback" not in err
    assert not (tmp_path / "m").exists()


@pytest.mark.slow
def test_tiny_models_command_writes_the_named_familys_folder(capsys, tmp_path):
    pytest.importorskip("diffusers")
    family = registry.default_family()
    code, out, err = cli(capsys, "tiny-models", str(tmp_path / "m"), "--pipeline", family.pipelines[-1].name)
    assert code == 0, err
    index = json.loads((tmp_path / "m" / "model_index.json").read_text())
    assert index["_class_name"] == family.diffusers_pipelines[0] and family.title in out


def test_lora_errors_say_what_is_wrong():
    """Unknown target names are "no such modules"; a module peft cannot adapt is peft's own reason."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("peft")
    from unitgraph.backends.diffusion.models.lora import add_lora

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    with pytest.raises(BackendError, match="--lora_target_modules nope: no such modules in m"):
        add_lora(model, "m", ["nope"], 2, None, seed=0)
    with pytest.raises(BackendError) as exc:
        add_lora(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4)), "m", ["1"], 2, None, seed=0)
    assert "peft cannot add a LoRA adapter to m" in exc.value.one_line() and "no such modules" not in exc.value.one_line()
    adapted = torch.nn.Sequential(torch.nn.Linear(4, 4))
    add_lora(adapted, "m", ["0"], 2, None, seed=0)
    assert sorted(n for n, p in adapted.named_parameters() if p.requires_grad) == ["0.lora_A.default.weight",
                                                                                    "0.lora_B.default.weight"]


def test_every_familys_declarations_import_no_torch():
    """Building every pipeline of every family from a fresh process imports no torch (declarations only);
    test_diffusion_backend checks the same for planning one pipeline through `diffusion:` references."""
    code = ("import sys; from unitgraph.backends.diffusion import registry; "
            "[p.spec() for f in registry.families() for p in f.pipelines]; "
            "print([m for m in ('torch', 'diffusers', 'transformers') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
