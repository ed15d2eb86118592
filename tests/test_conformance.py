"""The conformance suite every registered family passes (docs: CONTRIBUTING.md, "Adding a family").

Parametrized over `registry.families()` and their pipelines, so a new family joins by registration
alone. For each pipeline, on the family's `test`-size tiny models for that pipeline (written with
`write_tiny_models(..., pipeline=NAME)`) and a dataset with the columns its declaration requires:

- the tiny folder loads with the pipeline's diffusers pipeline class (`PipelineDef.diffusers_pipeline`,
  default the family's first);
- split == unsplit (loss rows and trained weights within 1e-6) for a LoRA on the DiT and on every
  text encoder, in both cache modes, at the machine's default precision (fp32 on a CPU without bf16 kernels), and
  for each family's DiT LoRA at bf16 (tests/test_precision.py adds fp8 storage);
- stage 2 runs with the frozen encoders' folders deleted and the source data gone;
- the DiT LoRA file loads with the diffusers pipeline's `load_lora_weights`, and fusing it changes the
  DiT's weights by exactly what our adapter adds (alpha included);
- stage 1 over 2 processes computes every entry exactly once and makes the cache (entries and manifest)
  1 process makes (once per family: every family's first pipeline, all in one launch);
- for a pipeline released as experts (`Family.experts`: Wan 2.2 A14B, T2V and I2V), on its two-expert folder: one
  stage-1 cache serves each expert's stage 2, without the encoders and the data, exactly as its unsplit run.
"""

from __future__ import annotations

import contextlib
import csv
import importlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
diffusers = pytest.importorskip("diffusers")
pytest.importorskip("peft")
pytest.importorskip("accelerate")

from safetensors.torch import load, load_file  # noqa: E402

from unitgraph.backends.diffusion.errors import BackendError  # noqa: E402
from unitgraph.backends.diffusion.args import make_args
from unitgraph.backends.diffusion.cache.verify import verify_cache  # noqa: E402
from unitgraph.backends.diffusion.data.dataset import write_synthetic_dataset  # noqa: E402
from unitgraph.backends.diffusion.registry import families  # noqa: E402
from unitgraph.backends.diffusion.stages import run  # noqa: E402
from unitgraph.backends.diffusion.train.loop import read_loss_csv  # noqa: E402

SIZE = 32
SAMPLES = 3
BATCH_ATOL = 1e-5  # measured: up to 2.7e-6 (the VAEs' batched convolutions; the text encoders are exact)
VENV_BIN = Path(sys.executable).parent
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "ACCELERATE_USE_CPU": "true"}

PIPELINES = [(family, pipeline) for family in families() for pipeline in family.pipelines]
IDS = [pipeline.name for _, pipeline in PIPELINES]
# the pipelines released as a denoiser of experts (Wan 2.2 A14B: T2V and I2V), on the two-expert tiny folders
EXPERT_CASES = [(family, pipeline) for family, pipeline in PIPELINES if family.experts and family.experts.covers(pipeline.name)]
# every pipeline x every model a LoRA may sit on: the DiT and each text encoder the pipeline calls
LORA_CASES = [(family, pipeline, slot) for family, pipeline in PIPELINES
              for slot in [family.model_slots[0], *family.text_encoders] if slot in pipeline.spec_pipeline.models]


def quiet(_text: str) -> None:
    pass


def diffusers_class(family, pipeline) -> str:
    """The diffusers pipeline class a pipeline's tiny folder loads with."""
    return family.diffusers_class(pipeline)


def pipeline_slots(family, pipeline) -> list[str]:
    """The slots a pipeline uses: its models, their tokenizers and companions, the family's schedulers."""
    slots: list[str] = []
    for model in pipeline.spec_pipeline.models:
        slots += [model, *([family.slot(model).tokenizer] if family.slot(model).tokenizer else []),
                  *pipeline.companions.get(model, ())]
    slots += [s.name for s in family.slots if s.kind == "scheduler"]
    return list(dict.fromkeys(slots))


@contextlib.contextmanager
def _processor_without_video():
    """transformers 5 builds its Qwen2-VL processors only with a video processor, which needs torchvision
    (not installed here): let the class take video_processor=None, enough for images."""
    from transformers import ProcessorMixin

    check = ProcessorMixin.check_argument_for_proper_class

    def relaxed(self, name, arg):
        return None if arg is None and name == "video_processor" else check(self, name, arg)

    ProcessorMixin.check_argument_for_proper_class = relaxed
    try:
        yield
    finally:
        ProcessorMixin.check_argument_for_proper_class = check


def real_processor(slot, folder: Path):
    """The slot's processor class itself (not the loader's parts) from a processor folder, with or without torchvision."""
    from transformers import AutoImageProcessor, AutoTokenizer

    cls = getattr(importlib.import_module(slot.library), slot.class_name)
    try:
        return cls.from_pretrained(str(folder), local_files_only=True)
    except ImportError:
        with _processor_without_video():
            return cls(image_processor=AutoImageProcessor.from_pretrained(str(folder), local_files_only=True),
                       tokenizer=AutoTokenizer.from_pretrained(str(folder), local_files_only=True))


def load_diffusers_pipeline(family, pipeline, root: Path):
    """`<diffusers class>.from_pretrained(root)`; a processor transformers cannot build here is handed in ready-made."""
    cls = getattr(diffusers, diffusers_class(family, pipeline))
    overrides = {}
    for name in pipeline_slots(family, pipeline):
        slot = family.slot(name)
        if slot.kind == "processor" and (root / slot.subfolder).is_dir():
            overrides[slot.subfolder] = real_processor(slot, root / slot.subfolder)
    return cls.from_pretrained(str(root), **overrides)


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    """(family, pipeline, experts=False) -> the test-size tiny pipeline folder for the pipeline's diffusers class,
    written once per session (pipelines of one class share it, unless the folder marks the pipeline); `experts`:
    the family's two-expert layout of it (Wan 2.2 A14B's)."""
    made: dict[tuple[str, str, str | None, bool], Path] = {}

    def get(family, pipeline, experts: bool = False) -> Path:
        # a pipeline its folder's model_index.json marks apart (Wan TI2V's expand_timesteps) has a folder of its own
        key = (family.name, diffusers_class(family, pipeline), pipeline.name if pipeline.index_marks else None, experts)
        if key not in made:
            made[key] = family.tiny_module().write_tiny_models(
                tmp_path_factory.mktemp(f"tiny-{family.name}") / "models", size="test", seed=0, pipeline=pipeline.name,
                **({"experts": True} if experts else {}))
        return made[key]

    return get


def extra_columns(pipeline) -> list[str]:
    """The required metadata columns beyond image and prompt (passed as --extra_inputs, as DiffSynth's commands do)."""
    return [c for c in pipeline.required if c not in ("image", "prompt")]


def extra_images(pipeline) -> list[str]:
    """The required image columns beyond the target image (edit_image, kontext_images, ...)."""
    return [c for c in pipeline.image_params if c in pipeline.required and c != "image"]


def images_per_sample(pipeline, column: str) -> int:
    """2 when the pipeline's model-free units that read `column` take a list of two images, else 1."""
    from PIL import Image

    from unitgraph.backends.diffusion.context import UnitContext

    two = [Image.new("RGB", (SIZE, SIZE)), Image.new("RGB", (SIZE, SIZE))]
    for unit in pipeline.units:
        if column in unit.inputs and not unit.models:
            try:
                unit(UnitContext(models={}), {p: two if p == column else None for p in unit.inputs})
            except BackendError:
                return 1
    return 2


def write_dataset(pipeline, folder: Path, count: int, seed: int) -> Path:
    """A small captioned image set with the columns the pipeline requires; returns its metadata file.

    Each required image column beyond the target gets a mirrored copy of the row's image, each video column
    a 5-frame clip of it scrolling; where the
    pipeline takes several images in such a column, a JSON metadata file lists two (the second a rotated copy).
    """
    required = set(pipeline.required)
    columns = extra_images(pipeline)
    videos = [c for c in pipeline.video_params if c in required]  # clips of 5 frames (2 latent frames)
    csv_path = write_synthetic_dataset(folder, count=count, size=SIZE, seed=seed, images=columns, videos=videos,
                                       distill=bool({"seed", "num_inference_steps"} & required))
    several = [c for c in columns if images_per_sample(pipeline, c) >= 2]
    if not several:
        return csv_path
    from PIL import Image

    with csv_path.open(newline="", encoding="utf-8") as handle:
        rows = list(csv.DictReader(handle))
    for row in rows:
        for column in several:
            second = row[column].replace(".png", "_b.png")
            with Image.open(folder / row[column]) as image:
                image.rotate(90).save(folder / second)
            row[column] = [row[column], second]
    path = folder / "metadata.json"
    path.write_text(json.dumps(rows, indent=1), encoding="utf-8")
    csv_path.unlink()
    return path


def metadata_file(data: Path) -> Path:
    json_path = data / "metadata.json"
    return json_path if json_path.is_file() else data / "metadata.csv"


@pytest.fixture(scope="session")
def datasets(tmp_path_factory):
    """pipeline name -> a small captioned image set with the columns its declaration requires."""
    made: dict[str, Path] = {}

    def get(pipeline) -> Path:
        if pipeline.name not in made:
            folder = tmp_path_factory.mktemp(f"data-{pipeline.name}")
            write_dataset(pipeline, folder, count=SAMPLES, seed=3)
            made[pipeline.name] = folder
        return made[pipeline.name]

    return get


def flags(family, pipeline, models: Path, data: Path, lora: str, **extra):
    kwargs = dict(pipeline=pipeline.name, dataset_base_path=str(data), dataset_metadata_path=str(metadata_file(data)),
                  model_paths=str(models), lora_base_model=lora, lora_rank=4, max_pixels=SIZE * SIZE, seed=5,
                  learning_rate=1e-3, progress=False, plot=False)  # the machine's default precision (bf16 cases below)
    if extra_columns(pipeline):
        kwargs["extra_inputs"] = ",".join(extra_columns(pipeline))
    kwargs.update(extra)
    return kwargs


def assert_same_training(a: Path, b: Path, checkpoint: str = "epoch-0.safetensors") -> None:
    la, lb = read_loss_csv(a / "loss.csv"), read_loss_csv(b / "loss.csv")
    assert [(r["step"], r["epoch"]) for r in la] == [(r["step"], r["epoch"]) for r in lb] and la
    assert [r["loss"] for r in la] == pytest.approx([r["loss"] for r in lb], abs=1e-6, rel=0)
    wa, wb = load_file(str(a / checkpoint)), load_file(str(b / checkpoint))
    assert set(wa) == set(wb) and wa
    for key in wa:
        assert torch.allclose(wa[key], wb[key], atol=1e-6, rtol=0), key


@pytest.mark.parametrize("family, pipeline", PIPELINES, ids=IDS)
def test_tiny_models_load_with_the_familys_diffusers_pipeline(family, pipeline, tiny_models):
    root = tiny_models(family, pipeline)
    assert json.loads((root / "model_index.json").read_text())["_class_name"] == diffusers_class(family, pipeline)
    pipe = load_diffusers_pipeline(family, pipeline, root)
    assert type(pipe).__name__ == diffusers_class(family, pipeline)
    for name in pipeline_slots(family, pipeline):
        slot = family.slot(name)
        component = getattr(pipe, slot.subfolder)
        assert type(component).__name__ in slot.class_names or slot.kind == "tokenizer", slot.name


@pytest.mark.slow
@pytest.mark.parametrize("family, pipeline, lora", LORA_CASES,
                         ids=[f"{p.name}-{slot}" for _, p, slot in LORA_CASES])
def test_split_equals_unsplit_in_both_cache_modes(family, pipeline, lora, tiny_models, datasets, tmp_path):
    models, data = tiny_models(family, pipeline), datasets(pipeline)
    task = pipeline.task
    unsplit = run(make_args(task=task, output_path=str(tmp_path / "unsplit"), **flags(family, pipeline, models, data, lora)),
                  echo=quiet)
    assert unsplit.steps == SAMPLES
    for mode in ("latest", "versioned"):
        out = tmp_path / mode
        split = run(make_args(task=f"{task}:split", output_path=str(out), cache_mode=mode,
                              **flags(family, pipeline, models, data, lora)), echo=quiet)
        assert lora in split.plan.train_models
        assert_same_training(tmp_path / "unsplit", out)
    keys = load_file(str(tmp_path / "unsplit" / "epoch-0.safetensors"))
    prefix = family.slot(lora).lora_prefix
    assert all(k.startswith(f"{prefix}.") and "lora_" in k for k in keys)


BF16_CASES = [(family, family.pipelines[0]) for family in families()]


@pytest.mark.slow
@pytest.mark.parametrize("family, pipeline", BF16_CASES, ids=[p.name for _, p in BF16_CASES])
def test_split_equals_unsplit_at_bf16(family, pipeline, tiny_models, datasets, tmp_path):
    """The cases above run at the machine's default precision (fp32 on a CPU without bf16 kernels, where bf16 is
    emulated tens of times slower); each family's DiT LoRA is checked at DiffSynth's bf16 here."""
    models, data = tiny_models(family, pipeline), datasets(pipeline)
    dit = family.model_slots[0]
    run(make_args(task=pipeline.task, output_path=str(tmp_path / "unsplit"), mixed_precision="bf16",
                  **flags(family, pipeline, models, data, dit)), echo=quiet)
    split = run(make_args(task=f"{pipeline.task}:split", output_path=str(tmp_path / "split"), mixed_precision="bf16",
                          **flags(family, pipeline, models, data, dit)), echo=quiet)
    assert split.cache_path is not None
    assert_same_training(tmp_path / "unsplit", tmp_path / "split")


@pytest.mark.slow
@pytest.mark.parametrize("family, pipeline", PIPELINES, ids=IDS)
def test_stage2_needs_neither_the_frozen_encoders_nor_the_data(family, pipeline, tiny_models, datasets, tmp_path):
    models = tmp_path / "models"
    shutil.copytree(tiny_models(family, pipeline), models)
    data = tmp_path / "data"
    shutil.copytree(datasets(pipeline), data)
    dit = family.model_slots[0]
    stage1 = run(make_args(task=f"{pipeline.task}:data_process", output_path=str(tmp_path / "cache"),
                           **flags(family, pipeline, models, data, dit)), echo=quiet)
    frozen = [slot for slot in stage1.plan.data_process_models if slot not in stage1.plan.train_models]
    assert frozen, "the plan keeps some encoder out of training"
    for slot in frozen:
        shutil.rmtree(models / family.slot(slot).subfolder)
    shutil.rmtree(data)
    train = flags(family, pipeline, models, tmp_path / "cache", dit, dataset_metadata_path=None)
    result = run(make_args(task=f"{pipeline.task}:train", output_path=str(tmp_path / "train"), **train), echo=quiet)
    assert result.steps == SAMPLES and result.plan.train_models == [dit]


@pytest.mark.slow
@pytest.mark.parametrize("family, pipeline", PIPELINES, ids=IDS)
def test_dit_lora_loads_in_the_diffusers_pipeline(family, pipeline, tiny_models, datasets, tmp_path):
    from peft.utils import get_peft_model_state_dict

    models, data = tiny_models(family, pipeline), datasets(pipeline)
    dit = family.slot(family.model_slots[0])
    result = run(make_args(task=f"{pipeline.task}:split", output_path=str(tmp_path / "out"), lora_alpha=8.0,
                           **flags(family, pipeline, models, data, dit.name)), echo=quiet)
    ckpt = result.last_checkpoint
    saved = load_file(str(ckpt))
    pipe = load_diffusers_pipeline(family, pipeline, models)
    denoiser = getattr(pipe, dit.lora_prefix)
    before = {k: v.clone() for k, v in denoiser.state_dict().items()}
    pipe.load_lora_weights(str(ckpt))
    adapter = next(iter(denoiser.peft_config))  # diffusers names the adapter itself
    loaded = get_peft_model_state_dict(denoiser, adapter_name=adapter)
    assert saved and {f"{dit.lora_prefix}.{name}" for name in loaded} >= set(saved)
    for name, value in loaded.items():
        key = f"{dit.lora_prefix}.{name}"
        if key in saved:
            assert torch.equal(value, saved[key]), key
        else:  # a loader may add zero adapters (diffusers' Wan I2V does for the image K/V beside a text K/V LoRA)
            assert not value.any(), key
    pipe.fuse_lora()
    after = {k: v for k, v in denoiser.state_dict().items() if "lora_" not in k}
    changed = [k for k in after if k.replace(".base_layer", "") in before and
               not torch.equal(after[k], before[k.replace(".base_layer", "")])]
    assert changed, "the LoRA changes the DiT"
    # the fused change is exactly scale * B @ A with the trained alpha (8) over the rank (4)
    name = next(k for k in saved if k.endswith("lora_A.weight"))
    module = name[len(dit.lora_prefix) + 1: -len(".lora_A.weight")]
    delta = (saved[name.replace("lora_A", "lora_B")] @ saved[name]) * (8.0 / 4)
    weight = f"{module}.base_layer.weight" if f"{module}.base_layer.weight" in after else f"{module}.weight"
    assert torch.allclose(after[weight] - before[f"{module}.weight"], delta, atol=1e-6)


def stage1_argv(family, pipeline, models: Path, data: Path, metadata: Path) -> list[str]:
    argv = ["train", "--pipeline", pipeline.name, "--task", f"{pipeline.task}:data_process", "--dataset_base_path", str(data),
            "--dataset_metadata_path", str(metadata), "--model_paths", str(models),
            "--lora_base_model", family.model_slots[0], "--max_pixels", str(SIZE * SIZE), "--no-progress",
            "--mixed_precision", "bf16"]  # bit-equal to one process: at fp32, SDXL's pooled embedding moves an ulp
    if extra_columns(pipeline):
        argv += ["--extra_inputs", ",".join(extra_columns(pipeline))]
    return argv


def first_expert_pipeline(family):
    return next(p for p in family.pipelines if family.experts.covers(p.name))


@pytest.fixture(scope="session")
def two_process_stage1(tiny_models, tmp_path_factory):
    """(pipeline, experts=False) -> (data folder, metadata file, the 2-process stage-1 cache folder, rank 0's output),
    for each family's first pipeline, and for the first pipeline of a family's experts on its two-expert folder: the
    families' stage 1 over 2 processes, all in one launch (tests/two_process_stage1.py: the interpreters' start and
    imports, ~10 s a launch on 2 cores, paid once)."""
    root = tmp_path_factory.mktemp("two-process")
    runs = [(f, f.pipelines[0], False) for f in families()]
    runs += [(f, first_expert_pipeline(f), True) for f in families() if f.experts]
    jobs, made = [], {}
    for family, pipeline, experts in runs:
        name = f"{pipeline.name}{'-experts' if experts else ''}"
        data = root / f"data-{name}"
        metadata = write_dataset(pipeline, data, count=5, seed=4)
        output = root / f"two-{name}"
        jobs.append({"argv": stage1_argv(family, pipeline, tiny_models(family, pipeline, experts), data, metadata),
                     "output": str(output)})
        made[(pipeline.name, experts)] = (data, metadata, output)
    (root / "jobs.json").write_text(json.dumps(jobs, indent=1), encoding="utf-8")
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
              "--num_machines", "1", "--main_process_port", "0", "--mixed_precision", "no", "--dynamo_backend", "no",
              str(Path(__file__).parent / "two_process_stage1.py"), str(root / "jobs.json")]
    done = subprocess.run(launch, capture_output=True, text=True, env=ENV, timeout=900)

    def get(pipeline, experts: bool = False):
        data, metadata, output = made[(pipeline.name, experts)]
        out = output.parent / f"{output.name}.rank0.out"
        code = output.parent / f"{output.name}.rank0.code"
        assert code.is_file(), f"the launch ended before this run (exit {done.returncode}): {done.stderr[-3000:]}"
        text = out.read_text(encoding="utf-8")
        assert code.read_text() == "0", text[-3000:]
        return data, metadata, output, text

    return get


@pytest.mark.slow
@pytest.mark.parametrize("family, pipeline", PIPELINES, ids=IDS)
def test_two_process_and_batched_stage1_give_the_same_entries(family, pipeline, tiny_models, two_process_stage1,
                                                              tmp_path):
    models = tiny_models(family, pipeline)
    first = pipeline.name == family.pipelines[0].name
    if first:
        data, metadata, two, stdout = two_process_stage1(pipeline)
    else:
        data = tmp_path / "data"
        metadata = write_dataset(pipeline, data, count=5, seed=4)
    # the references: one process, in this one (same flags), and the same with the encoders' calls batched
    for name, batch in (("one", None), ("batched", 4)):
        run(make_args(task=f"{pipeline.task}:data_process", pipeline=pipeline.name, dataset_base_path=str(data),
                      dataset_metadata_path=str(metadata), model_paths=str(models), lora_base_model=family.model_slots[0],
                      max_pixels=SIZE * SIZE, output_path=str(tmp_path / name), progress=False, data_process_batch_size=batch,
                      mixed_precision="bf16",
                      **({"extra_inputs": ",".join(extra_columns(pipeline))} if extra_columns(pipeline) else {})), echo=quiet)
    entries = lambda c: {p.name: p.read_bytes() for p in (Path(c) / "entries").iterdir()}  # noqa: E731
    # two processes: once per family (the sharding is the family-agnostic stage 1), all families in one launch
    if first:
        assert "computed 5 entries over 2 processes (3, 2)" in stdout, stdout
        problems, stats = verify_cache(two)
        assert problems == [] and stats["entries"] == 5
        assert entries(tmp_path / "one") == entries(two)  # same keys, same bytes
        manifest = lambda c: json.loads((Path(c) / "manifest.json").read_text())  # noqa: E731
        assert manifest(tmp_path / "one") == manifest(two)
    problems, stats = verify_cache(tmp_path / "one")
    assert problems == [] and stats["entries"] == 5
    # batched encoder calls: the same entries, each value within the batched kernels' rounding of its unbatched one
    one, batched = entries(tmp_path / "one"), entries(tmp_path / "batched")
    assert set(one) == set(batched)
    for name in one:
        a, b = load(one[name]), load(batched[name])
        assert set(a) == set(b)
        for key in a:
            assert a[key].shape == b[key].shape and torch.allclose(a[key], b[key], atol=BATCH_ATOL, rtol=0), (name, key)


@pytest.mark.slow
@pytest.mark.parametrize("family, pipeline", EXPERT_CASES, ids=[p.name for _, p in EXPERT_CASES])
def test_the_experts_share_one_stage1_and_each_trains_without_the_encoders_and_the_data(
        family, pipeline, tiny_models, two_process_stage1, tmp_path):
    """On the two-expert folder: one stage-1 cache, with no expert chosen (over 2 processes for the family's first
    such pipeline, exactly as 1 process makes it); each expert's stage 2 from it, the frozen encoders' folders deleted
    and the clips gone, trains exactly as that expert's unsplit run."""
    models = tiny_models(family, pipeline, experts=True)
    dit = family.model_slots[0]
    common = flags(family, pipeline, models, tmp_path, dit, mixed_precision="bf16")  # as the launch's stage 1
    del common["dataset_base_path"], common["dataset_metadata_path"]
    if pipeline.name == first_expert_pipeline(family).name:
        data, metadata, cache, stdout = two_process_stage1(pipeline, experts=True)
        assert "computed 5 entries over 2 processes (3, 2)" in stdout, stdout
        one = tmp_path / "one"
        run(make_args(task=f"{pipeline.task}:data_process", output_path=str(one), dataset_base_path=str(data),
                      dataset_metadata_path=str(metadata), **common), echo=quiet)
        assert {p.name: p.read_bytes() for p in (one / "entries").iterdir()} == \
            {p.name: p.read_bytes() for p in (cache / "entries").iterdir()}
    else:
        data = tmp_path / "data"
        metadata = write_dataset(pipeline, data, count=SAMPLES, seed=4)
        cache = tmp_path / "cache"
        run(make_args(task=f"{pipeline.task}:data_process", output_path=str(cache), dataset_base_path=str(data),
                      dataset_metadata_path=str(metadata), **common), echo=quiet)
    for expert in family.experts.names:
        plan = run(make_args(task=pipeline.task, output_path=str(tmp_path / f"unsplit-{expert}"), expert=expert,
                             dataset_base_path=str(data), dataset_metadata_path=str(metadata), **common),
                   echo=quiet).plan
    bare = tmp_path / "bare"
    shutil.copytree(models, bare)
    for slot in plan.data_process_models:
        if (bare / family.slot(slot).subfolder).is_dir():
            shutil.rmtree(bare / family.slot(slot).subfolder)
    away = data.with_name(data.name + "-away")
    data.rename(away)  # the clips are gone while stage 2 runs
    try:
        for expert in family.experts.names:
            out = tmp_path / f"split-{expert}"
            result = run(make_args(task=f"{pipeline.task}:train", output_path=str(out), expert=expert,
                                   dataset_base_path=str(cache), **dict(common, model_paths=str(bare))), echo=quiet)
            assert result.plan.train_models == [dit]
            assert_same_training(tmp_path / f"unsplit-{expert}", out)
    finally:
        away.rename(data)


def test_every_family_is_complete():
    """What the generic machinery reads from a family is there: a tiny builder with both sizes, a
    diffusers pipeline class, a denoiser with default LoRA targets, tasks the CLI knows."""
    from unitgraph.backends.diffusion.args import TASKS

    for family in families():
        tiny = family.tiny_module()
        assert {"test", "demo"} <= set(tiny.SIZES), family.name
        assert hasattr(importlib.import_module("diffusers"), family.diffusers_pipelines[0]), family.name
        for pipeline in family.pipelines:
            assert hasattr(importlib.import_module("diffusers"), diffusers_class(family, pipeline)), pipeline.name
            assert diffusers_class(family, pipeline) in family.diffusers_pipelines, pipeline.name
        dit = family.slot(family.model_slots[0])
        assert dit.lora_prefix and dit.lora_targets, family.name
        assert all(family.slot(t).lora_targets for t in family.text_encoders), family.name
        assert all(task in TASKS for task in family.tasks), family.name
