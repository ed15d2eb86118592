"""`diffsynth:` references: DiffSynth-Studio pipeline units read statically from a source folder,
or through an importable `diffsynth` package (a stand-in written by the test, and the real one when
it is installed), with `requires` from `process` guards and warnings for declaration mistakes."""

from __future__ import annotations

import ast
import importlib.util
import json
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import unitgraph as ug
from unitgraph.adapters import AdapterNote, DeclarationWarning
from unitgraph.adapters.diffsynth import analyse_process, from_installed, from_source, resolve
from unitgraph.audit import audit
from unitgraph.graph import VersionGraph
from unitgraph.prune import prune
from unitgraph.soundness import unsplit_reads

BASE_PIPELINE = '''
class PipelineUnit:
    def __init__(self, seperate_cfg=False, take_over=False, input_params=None, output_params=None,
                 input_params_posi=None, input_params_nega=None, onload_model_names=None):
        self.seperate_cfg = seperate_cfg
        self.take_over = take_over
        self.input_params = input_params
        self.output_params = output_params
        self.input_params_posi = input_params_posi
        self.input_params_nega = input_params_nega
        self.onload_model_names = onload_model_names

    def process(self, pipe, **kwargs):
        return {}


class BasePipeline:
    def __init__(self, device="cuda", torch_dtype=None, height_division_factor=64, width_division_factor=64):
        self.device = device
        self.torch_dtype = torch_dtype
'''

# A Z-Image-like pipeline in DiffSynth-Studio's style, with the mistakes the adapter must report:
# - ShapeChecker returns height/width without declaring output_params (an older DiffSynth style);
# - EditImageEmbedder declares output_params=("edit_latents"): the string, not a tuple;
# - EditImageSiglip declares onload_model_names=("siglip_edit_encoder"): "dit" is a substring of it.
# And two hazards the update-chain rule misses when the text encoder is trained:
# - PromptEmbedder reads edit_image before EditImageAutoResize rewrites it (write-after-read);
# - PromptEmbedder writes prompt_emb_mask, which PromptPadding rewrites later (write-after-write).
TOY_IMAGE = '''
import random

from ..diffusion.base_pipeline import BasePipeline, PipelineUnit
from .toy_shared import ToyUnit_EntityControl


class ToyImagePipeline(BasePipeline):
    def __init__(self, device="cuda", torch_dtype=None):
        super().__init__(device=device, torch_dtype=torch_dtype, height_division_factor=16, width_division_factor=16)
        self.text_encoder = None
        self.dit = None
        self.vae = None
        self.siglip_edit_encoder = None
        self.in_iteration_models = ("dit",)
        self.units = [
            ToyUnit_ShapeChecker(),
            ToyUnit_PromptEmbedder(),
            ToyUnit_PromptPadding(),
            ToyUnit_NoiseInitializer(),
            ToyUnit_InputImageEmbedder(),
            ToyUnit_EditImageAutoResize(),
            ToyUnit_EditImageEmbedder(),
            ToyUnit_EditImageSiglip(),
            ToyUnit_EntityControl(),
            ToyUnit_CaptionDropout(),
        ]


class ToyUnit_ShapeChecker(PipelineUnit):
    def __init__(self):
        super().__init__(input_params=("height", "width"))

    def process(self, pipe, height, width):
        return {"height": height // 16 * 16, "width": width // 16 * 16}


class ToyUnit_PromptEmbedder(PipelineUnit):
    def __init__(self):
        super().__init__(
            seperate_cfg=True,
            input_params=("edit_image",),
            input_params_posi={"prompt": "prompt"},
            input_params_nega={"prompt": "negative_prompt"},
            output_params=("prompt_emb", "prompt_emb_mask"),
            onload_model_names=("text_encoder",),
        )

    def process(self, pipe, prompt, edit_image=None):
        if prompt is None:
            return {}
        return {"prompt_emb": pipe.text_encoder(prompt, edit_image), "prompt_emb_mask": None}


class ToyUnit_PromptPadding(PipelineUnit):
    def __init__(self):
        super().__init__(input_params=("prompt",), output_params=("prompt_emb_mask",))

    def process(self, pipe, prompt):
        return {"prompt_emb_mask": [1] * len(prompt)}


class ToyUnit_NoiseInitializer(PipelineUnit):
    def __init__(self):
        super().__init__(input_params=("height", "width", "seed"), output_params=("noise",))

    def process(self, pipe, height, width, seed):
        return {"noise": pipe.generate_noise((1, 16, height // 8, width // 8), seed=seed)}


class ToyUnit_InputImageEmbedder(PipelineUnit):
    def __init__(self):
        super().__init__(input_params=("input_image", "noise"), output_params=("latents", "input_latents"),
                         onload_model_names=("vae",))

    def process(self, pipe, input_image, noise):
        if input_image is None:
            return {"latents": noise, "input_latents": None}
        return {"latents": noise, "input_latents": pipe.vae(input_image)}


class ToyUnit_EditImageAutoResize(PipelineUnit):
    def __init__(self):
        super().__init__(input_params=("edit_image", "edit_image_auto_resize"), output_params=("edit_image",))

    def process(self, pipe, edit_image, edit_image_auto_resize):
        if edit_image is None:
            return {}
        if edit_image_auto_resize is None or not edit_image_auto_resize:
            return {}
        return {"edit_image": edit_image}


class ToyUnit_EditImageEmbedder(PipelineUnit):
    def __init__(self):
        super().__init__(input_params=("edit_image",), output_params=("edit_latents"), onload_model_names=("vae",))

    def process(self, pipe, edit_image):
        if edit_image is None:
            return {}
        return {"edit_latents": pipe.vae(edit_image)}


class ToyUnit_EditImageSiglip(PipelineUnit):
    def __init__(self):
        super().__init__(input_params=("edit_image",), output_params=("edit_feats",),
                         onload_model_names=("siglip_edit_encoder"))

    def process(self, pipe, edit_image):
        if edit_image is None:
            return
        return {"edit_feats": pipe.siglip_edit_encoder(edit_image)}


class ToyUnit_CaptionDropout(PipelineUnit):
    def __init__(self):
        super().__init__(input_params=("prompt_emb",), output_params=("prompt_emb",))

    def process(self, pipe, prompt_emb):
        if self.drop():
            return {"prompt_emb": prompt_emb * 0}
        return {"prompt_emb": prompt_emb}

    def drop(self):
        return random.random() < 0.1
'''

TOY_SHARED = '''
from ..diffusion.base_pipeline import PipelineUnit


class ToyUnit_EntityControl(PipelineUnit):
    def __init__(self):
        super().__init__(
            take_over=True,
            input_params=("eligen_entity_prompts", "width", "height"),
            output_params=("entity_prompt_emb", "entity_masks"),
            onload_model_names=("text_encoder",),
        )

    def process(self, pipe, inputs_shared, inputs_posi, inputs_nega):
        prompts, masks = inputs_shared.get("eligen_entity_prompts", None), inputs_shared.get("eligen_entity_masks", None)
        if prompts is None or masks is None or len(prompts) == 0:
            return inputs_shared, inputs_posi, inputs_nega
        kwargs = {"entity_prompt_emb": pipe.text_encoder(prompts), "entity_masks": masks}
        inputs_posi.update(kwargs)
        inputs_shared["entity_width"] = inputs_shared["width"]
        return inputs_shared, inputs_posi, inputs_nega
'''


def write_package(root: Path) -> Path:
    """A DiffSynth-Studio-shaped source tree under `root`: root/diffsynth/{diffusion,pipelines}/..."""
    files = {
        "diffsynth/__init__.py": "",
        "diffsynth/diffusion/__init__.py": "",
        "diffsynth/diffusion/base_pipeline.py": BASE_PIPELINE,
        "diffsynth/pipelines/__init__.py": "",
        "diffsynth/pipelines/toy_image.py": TOY_IMAGE,
        "diffsynth/pipelines/toy_shared.py": TOY_SHARED,
    }
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return root


@pytest.fixture
def source(tmp_path: Path) -> Path:
    return write_package(tmp_path / "DiffSynth-Studio")


def load_static(source: Path, **options) -> tuple[ug.Pipeline, list[warnings.WarningMessage]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pipeline = from_source(source, "toy_image", "ToyImagePipeline", **options)
    return pipeline, [w for w in caught if issubclass(w.category, AdapterNote)]


def by_name(pipeline: ug.Pipeline) -> dict[str, ug.Unit]:
    return {u.name: u for u in pipeline.units}


def test_static_reading_maps_every_declaration(source):
    pipeline, _ = load_static(source)
    units = by_name(pipeline)
    assert pipeline.name == "ToyImagePipeline"
    assert list(units) == ["ShapeChecker", "PromptEmbedder", "PromptPadding", "NoiseInitializer", "InputImageEmbedder",
                           "EditImageAutoResize", "EditImageEmbedder", "EditImageSiglip", "EntityControl",
                           "CaptionDropout"]
    # outputs the code returns count even when output_params forgets them
    assert set(units["ShapeChecker"].outputs) == {"height", "width"}
    # positive and negative prompt params are both inputs; input_params too
    assert units["PromptEmbedder"].inputs == ("edit_image", "prompt", "negative_prompt")
    assert units["PromptEmbedder"].models == ("text_encoder",)
    assert units["PromptEmbedder"].requires == ("prompt",)
    # a bare string means the one-element tuple it was meant to be
    assert units["EditImageEmbedder"].outputs == ("edit_latents",)
    assert units["EditImageSiglip"].models == ("siglip_edit_encoder",)
    # randomness: pipe.generate_noise, and random.random() in a method process calls
    assert not units["NoiseInitializer"].deterministic
    assert not units["CaptionDropout"].deterministic
    assert units["InputImageEmbedder"].deterministic
    # the sink: every param, and the in-iteration models
    assert pipeline.sink.models == ("dit",)
    assert set(pipeline.sink.inputs) == set(pipeline.params)


def test_requires_come_from_guards_that_return_nothing(source):
    units = by_name(load_static(source)[0])
    assert units["EditImageAutoResize"].requires == ("edit_image", "edit_image_auto_resize")
    assert units["EditImageEmbedder"].requires == ("edit_image",)
    assert units["EditImageSiglip"].requires == ("edit_image",)  # a bare `return` is nothing too
    # `return {"latents": noise, ...}` when the image is missing is not a no-op
    assert units["InputImageEmbedder"].requires == ()
    assert units["ShapeChecker"].requires == ()


def test_take_over_units_read_and_write_the_state_dicts(source):
    unit = by_name(load_static(source)[0])["EntityControl"]
    assert set(unit.inputs) >= {"eligen_entity_prompts", "eligen_entity_masks", "width", "height"}
    # update(kwargs) hides the keys: the declared outputs stand; the subscript store is seen
    assert set(unit.outputs) == {"entity_prompt_emb", "entity_masks", "entity_width"}
    assert set(unit.requires) == {"eligen_entity_prompts", "eligen_entity_masks"}
    assert unit.models == ("text_encoder",)


def test_declaration_mistakes_are_reported(source):
    _, notes = load_static(source)
    warned = [str(w.message) for w in notes if issubclass(w.category, DeclarationWarning)]
    assert len(warned) == 3, warned
    shape, edit, siglip = sorted(warned, key=lambda m: ("ShapeChecker" not in m, "EditImageEmbedder" not in m))
    assert "ShapeChecker: process returns height, width but output_params does not declare them" in shape
    assert "EditImageEmbedder: output_params=('edit_latents') is the string 'edit_latents', not a one-element tuple" in edit
    assert "characters ('e', 'd', 'i', 't', ...)" in edit
    assert "EditImageSiglip: onload_model_names=('siglip_edit_encoder')" in siglip
    assert "it also treats dit as called by this unit" in siglip


def test_with_prunes_the_optional_units(source):
    pipeline, _ = load_static(source)
    active, dropped = prune(pipeline, ["prompt", "input_image", "height", "width", "seed"])
    assert dropped == ["EditImageAutoResize", "EditImageEmbedder", "EditImageSiglip", "EntityControl"]
    plan = ug.split(pipeline, ["text_encoder"], "dit", provided=["prompt", "input_image", "height", "width", "seed"])
    assert plan.extra["inactive_units"] == dropped
    assert ug.verify(pipeline, plan) == []
    # pruning never changes the versions an active unit reads: run the full pipeline, inactive units as no-ops
    state: dict[str, str] = {}
    expected = {}
    for unit in pipeline.units:
        if unit.name in dropped:
            continue
        expected.update({(unit.name, p): state.get(p) for p in unit.inputs})
        state.update({p: unit.name for p in unit.outputs})
    kept = VersionGraph.of(active)
    pruned = {(kept.names[r], p): None if w is None else kept.names[w]
              for (r, p), w in unsplit_reads(kept).items() if r < kept.n}
    assert pruned == expected


def test_inspect_draws_inactive_units_greyed_out(source):
    from unitgraph.render import dot_source, render_text, to_mermaid

    pipeline, _ = load_static(source)
    plan = ug.split(pipeline, ["text_encoder"], "dit", provided=["prompt", "height", "width", "seed"])
    dot = dot_source(pipeline, plan)
    assert "cluster_inactive" in dot and "not run: requires edit_image" in dot
    assert "inactive: its `requires` are not provided" in dot  # in the legend
    assert "class x5,x6,x7,x8 inactive" in to_mermaid(pipeline, plan)
    text = " ".join(render_text(pipeline, plan).split())
    assert "inactive units: EditImageAutoResize, EditImageEmbedder, EditImageSiglip, EntityControl" in text
    assert "not run: requires eligen_entity_prompts, eligen_entity_masks" in text


def test_audit_names_the_hazards_the_update_chain_rule_misses(source):
    pipeline, _ = load_static(source)
    result = audit(pipeline, models=["text_encoder"])
    assert result.lora_base_model == "dit"
    case = next(c for c in result.cases if c.trainable_models == ["text_encoder"])
    hazards = {(h.unit, h.param, h.conflicts_with, h.kind) for h in case.hazards}
    assert hazards == {
        ("PromptPadding", "prompt_emb_mask", "PromptEmbedder", "write-after-write"),
        ("EditImageAutoResize", "edit_image", "PromptEmbedder", "write-after-read"),
    }
    pulled = [u for u, _ in case.pulled_along]
    assert pulled == ["EditImageEmbedder", "EditImageSiglip"]
    wrong = {(r.reader, r.param, r.got, r.want) for r in case.wrong_reads}
    assert ("PromptEmbedder", "edit_image", "EditImageAutoResize", None) in wrong
    assert ("sink", "prompt_emb_mask", "PromptEmbedder", "PromptPadding") in wrong
    assert not case.update_chain.sound and case.latest.sound and case.versioned.sound
    # the edit-image VAE encoder follows the hazard into stage 2, so vae stays loaded either way (the input
    # image encoder reads the noise); versioned keeps the SigLIP edit encoder out
    assert "siglip_edit_encoder" in case.latest.train_models
    assert "siglip_edit_encoder" not in case.versioned.train_models
    dit_only = result.cases[0]
    assert dit_only.trainable_models == [] and dit_only.hazards == []


def test_audit_command_text_and_json(source, tmp_path):
    ref = "diffsynth:toy_image.ToyImagePipeline"
    result = run_cli("audit", ref, "--source", str(source), "--models", "text_encoder")
    assert result.returncode == 0, result.stderr
    assert "misses 2 hazards" in result.stdout
    assert "EditImageAutoResize writes edit_image after PromptEmbedder read it (write-after-read)" in result.stdout
    assert "PromptPadding writes prompt_emb_mask after PromptEmbedder wrote it (write-after-write)" in result.stdout
    assert result.stderr.count("warning: diffsynth:") == 3
    out = tmp_path / "audit.json"
    result = run_cli("audit", ref, "--source", str(source), "-o", str(out))
    assert result.returncode == 0, result.stderr
    data = json.loads(out.read_text())
    assert data["format"] == "unitgraph.audit/v1" and data["cases_with_missed_hazards"] == 1
    assert {c["trainable_models"][0] for c in data["cases"] if c["trainable_models"]} == {
        "siglip_edit_encoder", "text_encoder", "vae"}


def test_plan_inspect_explain_and_verify_from_source(source, tmp_path):
    ref = "diffsynth:toy_image.ToyImagePipeline"
    plan_file = tmp_path / "plan.json"
    result = run_cli("plan", ref, "--source", str(source), "--lora-base-model", "dit", "--with", "prompt,height,width,seed",
                     "-o", str(plan_file))
    assert result.returncode == 0, result.stderr
    assert json.loads(plan_file.read_text())["inactive_units"] == [
        "EditImageAutoResize", "EditImageEmbedder", "EditImageSiglip", "EntityControl"]
    result = run_cli("verify", ref, str(plan_file), "--source", str(source))
    assert result.returncode == 0, result.stdout + result.stderr
    result = run_cli("inspect", ref, "--source", str(source), "--with", "prompt,height,width,seed", "-f", "text")
    assert result.returncode == 0, result.stderr
    assert "EditImageEmbedder" in result.stdout and "inactive" in result.stdout
    result = run_cli("explain", ref, "EditImageEmbedder", "--source", str(source), "--with", "prompt")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("EditImageEmbedder is inactive: it requires edit_image")


def test_bad_references_are_one_line_errors(source, tmp_path):
    for args, fragment in [
        (("diffsynth:toy_image.Nope", "--source", str(source)), "toy_image.py defines no class Nope"),
        (("diffsynth:no_such", "--source", str(source)), "no no_such.py under"),
        (("diffsynth:toy_image.ToyImagePipeline", "--source", str(tmp_path / "missing")), "is not a folder"),
        (("diffsynth:a.b.c", "--source", str(source)), "expected MODULE.Class"),
    ]:
        result = run_cli("plan", *args)
        assert result.returncode == 2, result.stderr
        assert fragment in result.stderr and "Traceback" not in result.stderr
        assert len(result.stderr.strip().splitlines()) == 1


@pytest.mark.skipif(importlib.util.find_spec("diffsynth") is not None, reason="DiffSynth-Studio is installed here")
def test_without_source_or_package_the_error_says_what_to_do():
    with pytest.raises(ug.SpecError, match="DiffSynth-Studio is not installed; pass --source PATH"):
        resolve("qwen_image.QwenImagePipeline")


def test_installed_package_path_reads_the_objects(source, monkeypatch):
    """The import path, on a stand-in `diffsynth` package (the real one is not needed)."""
    if importlib.util.find_spec("diffsynth") is not None:
        pytest.skip("a real diffsynth package is installed; the stand-in would shadow it")
    monkeypatch.syspath_prepend(str(source))
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            # the stand-in is on sys.path, not installed: importing it needs the permission
            installed = resolve("toy_image.ToyImagePipeline", trust_remote_code=True)
        static, _ = load_static(source)
        assert installed.to_dict() == static.to_dict()
        assert sum(issubclass(w.category, DeclarationWarning) for w in caught) == 3
    finally:
        for name in [m for m in sys.modules if m == "diffsynth" or m.startswith("diffsynth.")]:
            del sys.modules[name]


MARKER_INIT = """
from pathlib import Path
Path({marker!r}).write_text("diffsynth ran")
"""


@pytest.mark.skipif(importlib.util.find_spec("diffsynth") is not None, reason="a real diffsynth package is installed")
def test_a_diffsynth_package_that_is_not_installed_is_never_imported(source, tmp_path, monkeypatch):
    """A DiffSynth-Studio checkout in the working directory (`python -m` puts it on sys.path) is read
    with --source, statically; importing it needs --trust-remote-code."""
    marker = tmp_path / "MARKER"
    (source / "diffsynth" / "__init__.py").write_text(MARKER_INIT.format(marker=str(marker)))
    monkeypatch.chdir(source)
    monkeypatch.syspath_prepend(str(source))
    try:
        with pytest.raises(ug.SpecError) as info:
            resolve("toy_image.ToyImagePipeline")
        message = info.value.one_line()
        assert f"importing diffsynth would run code from {source / 'diffsynth'}, which is not an installed package" in message
        assert "--trust-remote-code allows it" in message and f"--source {source / 'diffsynth'}" in message
        assert "diffsynth" not in sys.modules and not marker.exists()
        # the static reading it suggests runs nothing, and needs no permission
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            static = resolve("toy_image.ToyImagePipeline", source=str(source / "diffsynth"))
        assert static.to_dict() == load_static(source)[0].to_dict() and not marker.exists()
        result = subprocess.run([sys.executable, "-m", "unitgraph.cli.app", "plan", "diffsynth:toy_image.ToyImagePipeline"],
                                capture_output=True, text=True, timeout=120, cwd=source)
        assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr
        assert "--trust-remote-code allows it" in result.stderr and not marker.exists()
        result = subprocess.run([sys.executable, "-m", "unitgraph.cli.app", "plan", "diffsynth:toy_image.ToyImagePipeline",
                                 "--trust-remote-code"], capture_output=True, text=True, timeout=120, cwd=source)
        assert result.returncode == 0, result.stderr
        assert marker.read_text() == "diffsynth ran"
    finally:
        for name in [m for m in sys.modules if m == "diffsynth" or m.startswith("diffsynth.")]:
            del sys.modules[name]


@pytest.mark.skipif(importlib.util.find_spec("diffsynth") is None, reason="DiffSynth-Studio is not installed")
def test_real_installed_qwen_image_pipeline():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pipeline = from_installed("qwen_image", "QwenImagePipeline")
    names = [u.name for u in pipeline.units]
    assert "PromptEmbedder" in names and "NoiseInitializer" in names
    assert "dit" in pipeline.sink.models
    plan = ug.split(pipeline, lora_base_model="dit")
    assert ug.verify(pipeline, plan) == []


def test_process_analysis_on_snippets():
    def facts(code: str, take_over: bool = False):
        func = ast.parse(textwrap.dedent(code)).body[0]
        return analyse_process(func, {}, take_over)

    f = facts("""
        def process(self, pipe, a, b, c):
            if a is None or not b:
                return dict()
            if c is None and a is None:
                return {}
            if c == 0:
                return {}
            return {"x": a, "y": b}
    """)
    assert f.guards == ["a", "b"] and f.returned == {"x", "y"} and not f.random
    f = facts("""
        def process(self, pipe, a):
            out = {"x": a}
            return out
    """)
    assert f.returned is None  # unknown keys: the declared outputs stand
    f = facts("""
        def process(self, pipe, shared, posi, nega):
            x = shared.get("x")
            if x is None:
                return shared, posi, nega
            posi["y"] = torch.randn(3)
            return shared, posi, nega
    """, take_over=True)
    assert f.guards == ["x"] and f.reads == ["x"] and f.writes == {"y"} and f.random


TOY_READER = '''
from ..diffusion.base_pipeline import BasePipeline, PipelineUnit


class ReaderPipeline(BasePipeline):
    def __init__(self, device="cuda", torch_dtype=None):
        super().__init__(device=device, torch_dtype=torch_dtype)
        self.in_iteration_models = ("dit",)
        self.units = [ReaderUnit_NoiseInitializer(), ReaderUnit_PromptEmbedder()]


class ReaderUnit_NoiseInitializer(PipelineUnit):
    def __init__(self):
        super().__init__(input_params=("height",), output_params=("noise",))

    def process(self, pipe, height):
        return {"noise": pipe.generate_noise((1, pipe.dit.in_channels, height))}


class ReaderUnit_PromptEmbedder(PipelineUnit):
    def __init__(self):
        super().__init__(input_params=("prompt", "height"), output_params=("emb",), onload_model_names=("text_encoder",))

    def process(self, pipe, prompt, height):
        return {"emb": self.encode(pipe, prompt, height)}

    def encode(self, pipe, prompt, height):
        return pipe.text_encoder(prompt)[:, : height // pipe.dit.patch_size]
'''


def test_a_model_read_but_not_named_is_a_warning_and_a_config_read(source):
    """A unit reading a model of the pipeline (directly or in a method it calls) that its onload_model_names does not
    name: one warning each, and the unit reads that model's config in the plan (stage 1 loads no weights for it)."""
    (source / "diffsynth" / "pipelines" / "toy_reader.py").write_text(textwrap.dedent(TOY_READER))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pipeline = from_source(source, "toy_reader", "ReaderPipeline")
    said = [str(w.message) for w in caught if issubclass(w.category, DeclarationWarning)]
    assert len([m for m in said if "reads the model dit (pipe.dit)" in m]) == 2, said
    units = by_name(pipeline)
    assert units["PromptEmbedder"].configs == ("dit",) and units["NoiseInitializer"].configs == ("dit",)
    plan = ug.split(pipeline, lora_base_model="dit")
    assert "PromptEmbedder" in plan.data_process_units and "dit" not in plan.data_process_models


def test_audit_of_every_pipeline_of_a_source(source, tmp_path):
    (source / "diffsynth" / "pipelines" / "toy_reader.py").write_text(textwrap.dedent(TOY_READER))
    done = run_cli("audit", "diffsynth:*", "--source", str(source), "-o", str(tmp_path / "all.json"))
    assert done.returncode == 0, done.stderr
    report = json.loads((tmp_path / "all.json").read_text())
    assert sorted(report["pipelines"]) == ["toy_image", "toy_reader"]
    assert "toy_shared" in report["unreadable"]  # a module of units without a pipeline class: one note, and on
    assert "2 pipelines audited" in done.stderr and "reads the model dit" in done.stderr


def _deps(code: str, assume=None):
    from unitgraph.adapters.diffsynth import output_dependencies

    found = output_dependencies(ast.parse(textwrap.dedent(code)).body[0], assume)
    return None if found is None else {k: sorted(v) for k, v in found.items()}


def test_output_dependencies_follow_data_control_and_mutation():
    """Each returned key's arguments: through assignments, calls (which may change their arguments), branches, early
    returns and loops; a return that is not a dict literal makes the whole answer unknown."""
    # an early return taints what follows with its condition
    assert _deps("""
        def process(self, pipe, image, noise, size):
            if image is None:
                return {"a": noise}
            scaled = pipe.resize(image, size)
            return {"a": noise, "b": scaled}
    """) == {"a": ["image", "noise"], "b": ["image", "size"]}
    # a call may change its arguments in place: `fill(out, noise)` taints out with noise, from there on only
    assert _deps("""
        def process(self, pipe, image, noise):
            out = pipe.encode(image)
            first = {"b": out}
            fill(out, noise)
            return {"b": out}
    """) == {"b": ["image", "noise"]}
    assert _deps("""
        def process(self, pipe, image, noise):
            out = pipe.encode(image)
            if pipe.flag:
                return {"b": out}
            fill(out, noise)
            return {"b": out}
    """, {"pipe.flag": True}) == {"b": ["image"]}
    # a branch taints what it assigns; both sides are joined
    assert _deps("""
        def process(self, pipe, a, b, c):
            if c:
                x = a
            else:
                x = 1
            return {"x": x}
    """) == {"x": ["a", "c"]}
    # a loop carries its values round
    assert _deps("""
        def process(self, pipe, a, b, n):
            x = 0
            y = 0
            for i in range(n):
                y = x
                x = a
            return {"y": y}
    """) == {"y": ["a", "n"]}
    assert _deps("""
        def process(self, pipe, a):
            out = {"x": a}
            return out
    """) is None
    # the negated assumption takes the other side
    assert _deps("""
        def process(self, pipe, a, b):
            if not pipe.training:
                return {"x": a}
            return {"x": b}
    """, {"pipe.training": True}) == {"x": ["b"]}


PARAMS = ("a", "b", "c")


@st.composite
def _programs(draw):
    """A `process` of assignments, in-place list appends, branches (some returning early) and a final return."""
    names = list(PARAMS)
    lines = ["def process(self, pipe, a, b, c):", "    acc = []"]
    names.append("acc")

    def expr():
        picked = draw(st.lists(st.sampled_from([n for n in names if n != "acc"]), min_size=1, max_size=3))
        return " + ".join(picked) + f" + {draw(st.integers(0, 3))}"

    def cond():  # one name against a constant: flips often as the arguments change
        return f"{draw(st.sampled_from([n for n in names if n != 'acc']))} > {draw(st.integers(0, 4))}"

    for i in range(draw(st.integers(1, 6))):
        kind = draw(st.sampled_from(["assign", "append", "if", "early"]))
        if kind == "assign":
            lines.append(f"    v{i} = {expr()}")
            names.append(f"v{i}")
        elif kind == "append":
            lines.append(f"    acc.append({expr()})")
        elif kind == "if":
            lines += [f"    if {cond()}:", f"        v{i} = {expr()}", "    else:",
                      f"        v{i} = {draw(st.integers(0, 3))}"]
            names.append(f"v{i}")
        else:
            early = draw(st.sampled_from([f"{{'x': {expr()}, 'y': 0}}", "{}"]))  # values, or nothing (a no-op)
            lines += [f"    if {cond()}:", f"        return {early}"]
    lines.append(f"    return {{'x': {expr()}, 'y': sum(acc) + {expr()}}}")
    return "\n".join(lines)


@settings(max_examples=150, deadline=None)
@given(_programs(), st.tuples(*[st.integers(0, 4)] * 3), st.tuples(*[st.integers(0, 4)] * 3))
def test_an_argument_outside_a_keys_dependencies_never_changes_it(code, first, second):
    """Soundness by execution: run a generated `process` on two argument tuples that differ only in arguments the
    analysis says key k does not depend on; k's value is the same."""
    from unitgraph.adapters.diffsynth import output_dependencies

    deps = output_dependencies(ast.parse(code).body[0])
    scope: dict = {}
    exec(compile(code, "<generated>", "exec"), scope)  # the test's own generated code
    for key in ("x", "y"):
        mixed = tuple(first[i] if name in deps[key] else second[i] for i, name in enumerate(PARAMS))
        assert scope["process"](None, None, *first).get(key) == scope["process"](None, None, *mixed).get(key), (code, key)


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "unitgraph.cli.app", *args], capture_output=True, text=True, timeout=120)
