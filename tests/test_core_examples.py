"""Worked examples with their expected plans, written out by hand."""

from __future__ import annotations

import pytest

import unitgraph as ug
from unitgraph.graph import VersionGraph
from unitgraph.plan import plan_from_train_set
from unitgraph.closure import LATEST, VERSIONED, update_chain_train_set
from unitgraph.soundness import find_violations


def pipeline(*units, sink=None, name="example"):
    made = [ug.Unit(n, tuple(i), tuple(o), tuple(m), d) for n, i, o, m, d in units]
    return ug.Pipeline(name, tuple(made), None if sink is None else ug.Sink(*sink))


def entries(plan):
    return [(p, w) for p, w in plan.cache_entries]


def test_design_example_lora_on_dit():
    p = pipeline(
        ("ShapeChecker", ["height", "width"], ["height", "width"], [], True),
        ("PromptEmbedder", ["prompt"], ["prompt_emb", "prompt_emb_mask"], ["text_encoder"], True),
        ("CaptionDropout", ["prompt_emb"], ["prompt_emb"], [], False),
        sink=(["input_latents", "prompt_emb", "prompt_emb_mask", "height", "width"], ["dit"]),
        name="qwen_image",
    )
    plan = ug.split(p, lora_base_model="dit")
    data = plan.to_dict()
    assert data["format"] == "unitgraph.plan/v1"
    assert data["models_require_backward"] == ["dit"]
    assert data["data_process"] == {"units": ["ShapeChecker", "PromptEmbedder"], "models": ["text_encoder"]}
    assert data["train"] == {"units": ["CaptionDropout"], "models": ["dit"]}
    assert data["cache"]["params"] == ["height", "input_latents", "prompt_emb", "prompt_emb_mask", "width"]
    assert entries(plan) == [
        ("height", "ShapeChecker"),
        ("input_latents", None),
        ("prompt_emb", "PromptEmbedder"),
        ("prompt_emb_mask", "PromptEmbedder"),
        ("width", "ShapeChecker"),
    ]
    assert data["checks"] == {"C1": True, "C2": True, "C3": True, "equivalence": True}
    assert data["reasons"] == {"CaptionDropout": "is non-deterministic, so it must run fresh every epoch (X0)"}
    assert data["fingerprint"].startswith("sha256:") and len(data["fingerprint"]) == 7 + 64


def test_training_the_text_encoder_moves_prompt_encoding_to_stage_2():
    p = pipeline(
        ("ShapeChecker", ["height", "width"], ["height", "width"], [], True),
        ("PromptEmbedder", ["prompt"], ["prompt_emb", "prompt_emb_mask"], ["text_encoder"], True),
        ("CaptionDropout", ["prompt_emb"], ["prompt_emb"], [], False),
        sink=(["input_latents", "prompt_emb", "prompt_emb_mask", "height", "width"], ["dit"]),
    )
    plan = ug.split(p, trainable_models=["text_encoder"], lora_base_model="dit")
    assert plan.train_units == ["PromptEmbedder", "CaptionDropout"]
    assert plan.train_models == ["dit", "text_encoder"]
    assert plan.data_process_models == []
    assert entries(plan) == [("height", "ShapeChecker"), ("input_latents", None), ("prompt", None), ("width", "ShapeChecker")]


def test_in_place_update_chain_follows_the_first_train_writer():
    # x is encoded (frozen), refined in place by a trainable model, then normalised in place
    p = pipeline(
        ("Encode", ["image"], ["x"], ["vae"], True),
        ("Refine", ["x"], ["x"], ["adapter"], True),
        ("Normalise", ["x"], ["x"], [], True),
        sink=(["x"], ["dit"]),
    )
    for mode in (LATEST, VERSIONED):
        plan = ug.split(p, trainable_models=["adapter"], lora_base_model="dit", cache_mode=mode)
        assert plan.train_units == ["Refine", "Normalise"]
        assert entries(plan) == [("x", "Encode")]
        assert plan.reasons["Normalise"] == "reads x written by Refine (F)"
        assert plan.train_models == ["adapter", "dit"]
        assert plan.data_process_models == ["vae"]


def test_write_after_read_hazard():
    """Resize rewrites the image after the trainable embedder read it: W pulls Resize in, U does not."""
    p = pipeline(
        ("Load", ["path"], ["image"], [], True),
        ("Embed", ["image"], ["image_emb"], ["siglip"], True),
        ("Resize", ["size"], ["image"], [], True),
        ("Encode", ["image"], ["latents"], ["vae"], True),
        sink=(["image_emb", "latents"], ["dit"]),
    )
    plan = ug.split(p, trainable_models=["siglip"], lora_base_model="dit")
    assert plan.train_units == ["Embed", "Resize", "Encode"]
    assert plan.reasons["Resize"] == "writes image after Embed read it: write-after-read (W)"
    assert plan.reasons["Encode"] == "reads image written by Resize (F)"
    assert entries(plan) == [("image", "Load"), ("size", None)]
    # versioned caching keeps Resize and the VAE out of training
    versioned = ug.split(p, trainable_models=["siglip"], lora_base_model="dit", cache_mode=VERSIONED)
    assert versioned.train_units == ["Embed"]
    assert entries(versioned) == [("image", "Load"), ("latents", "Encode")]
    assert versioned.train_models == ["dit", "siglip"]
    assert ug.plan.versioned_savings_line(p, plan) == (
        "note: --cache-mode versioned would keep vae out of training (stage 2 would not load it)"
    )


def test_the_update_chain_rule_alone_reads_wrong_versions():
    """DiffSynth-Studio's original rule U misses write-after-read and write-after-write; the simulation shows it."""
    war = pipeline(
        ("Load", ["path"], ["image"], [], True),
        ("Embed", ["image"], ["image_emb"], ["siglip"], True),
        ("Resize", ["size"], ["image"], [], True),
        sink=(["image_emb", "image"], ["dit"]),
    )
    waw = pipeline(
        ("Caption", ["prompt"], ["text"], ["captioner"], True),
        ("Template", ["style"], ["text"], [], True),
        sink=(["text"], ["dit"]),
    )
    for p, backward, wrong in (
        (war, {"siglip", "dit"}, "Embed reads image as the version written by Resize; unsplit it reads the version written by Load"),
        (waw, {"captioner", "dit"}, "the sink reads text as the version written by Caption; unsplit it reads the version written by Template"),
    ):
        vg = VersionGraph(p)
        u_only = plan_from_train_set(vg, frozenset(backward), update_chain_train_set(vg, frozenset(backward)), LATEST)
        problems = [str(v) for v in find_violations(p, u_only)]
        assert f"equivalence: {wrong}" in problems
        assert any(line.startswith("C3:") for line in problems)
        sound = ug.split(p, sorted(backward))
        assert ug.verify(p, sound) == []
        assert len(sound.train_units) > len(u_only.train_units)


def test_nondeterministic_noise_pulls_its_readers_into_training():
    p = pipeline(
        ("Encode", ["image"], ["latents"], ["vae"], True),
        ("Noise", ["seed"], ["noise"], [], False),
        ("Mix", ["latents", "noise"], ["noisy"], [], True),
        sink=(["noisy", "latents", "noise"], ["dit"]),
    )
    plan = ug.split(p, lora_base_model="dit")
    assert plan.train_units == ["Noise", "Mix"]
    assert plan.reasons["Mix"] == "reads noise written by Noise (F)"
    assert entries(plan) == [("latents", "Encode"), ("seed", None)]


def test_without_a_declared_sink_the_sink_reads_every_param_and_calls_only_backward_models():
    p = pipeline(
        ("Tokenize", ["prompt"], ["ids"], [], True),
        ("Embed", ["ids"], ["emb"], ["text_encoder"], True),
    )
    plan = ug.split(p, lora_base_model="dit")
    assert plan.train_units == []
    assert plan.train_models == ["dit"]
    assert plan.data_process_models == ["text_encoder"]
    assert entries(plan) == [("emb", "Embed"), ("ids", "Tokenize"), ("prompt", None)]


def test_a_model_nothing_calls_is_rejected_when_the_sink_is_declared():
    p = pipeline(("A", ["x"], ["y"], ["vae"], True), sink=(["y"], ["dit"]))
    with pytest.raises(ug.SpecError, match="model 'dti' needs backward but no unit or the sink calls it"):
        ug.split(p, lora_base_model="dti")


def test_versioned_mode_stores_two_versions_of_one_param():
    p = pipeline(
        ("Resize", ["image"], ["image"], [], True),
        ("Embed", ["image"], ["emb"], ["siglip"], True),
        ("Crop", ["image"], ["image"], [], True),
        ("Encode", ["image"], ["latents"], ["vae"], True),
        sink=(["emb", "latents"], ["dit"]),
    )
    plan = ug.split(p, trainable_models=["siglip"], lora_base_model="dit", cache_mode=VERSIONED)
    assert plan.train_units == ["Embed"]
    assert entries(plan) == [("image", "Resize"), ("latents", "Encode")]
    assert plan.checks == {"C1": True, "C2": None, "C3": None, "equivalence": True}
    # Two units in train reading different versions of the same param
    q = pipeline(
        ("Resize", ["image"], ["image"], [], True),
        ("Embed", ["image"], ["emb"], ["siglip"], True),
        ("Crop", ["image"], ["image"], [], True),
        ("Embed2", ["image"], ["emb2"], ["siglip"], True),
        sink=(["emb", "emb2"], ["dit"]),
    )
    plan = ug.split(q, trainable_models=["siglip"], lora_base_model="dit", cache_mode=VERSIONED)
    assert plan.train_units == ["Embed", "Embed2"]
    assert entries(plan) == [("image", "Resize"), ("image", "Crop")]
    assert plan.to_dict()["cache"]["params"] == ["image"]
    assert ug.verify(q, plan) == []


def test_plan_round_trips_through_json(tmp_path):
    p = pipeline(("A", ["x"], ["y"], ["vae"], True), ("B", ["y"], ["z"], [], False), sink=(["z", "y"], ["dit"]))
    plan = ug.split(p, lora_base_model="dit")
    path = tmp_path / "plan.json"
    path.write_text(plan.to_json())
    again = ug.read_plan_file(path)
    assert again.to_dict() == plan.to_dict()
    assert ug.verify(p, again) == []


def test_fingerprint_changes_with_spec_models_and_mode_but_not_with_declaration_order():
    a = pipeline(("A", ["x", "w"], ["y"], ["vae"], True), sink=(["y"], ["dit"]))
    b = pipeline(("A", ["w", "x"], ["y"], ["vae"], True), sink=(["y"], ["dit"]))
    c = pipeline(("A", ["x", "w"], ["y", "q"], ["vae"], True), sink=(["y"], ["dit"]))
    fp = lambda p, **kw: ug.split(p, **kw).fingerprint  # noqa: E731
    assert fp(a, lora_base_model="dit") == fp(b, lora_base_model="dit")
    assert fp(a, lora_base_model="dit") != fp(c, lora_base_model="dit")
    assert fp(a, lora_base_model="dit") != fp(a, trainable_models=["vae"], lora_base_model="dit")
    assert fp(a, lora_base_model="dit") != fp(a, lora_base_model="dit", cache_mode=VERSIONED)


def test_verify_reports_each_kind_of_tampering():
    p = pipeline(
        ("Encode", ["image"], ["latents"], ["vae"], True),
        ("Noise", ["seed"], ["noise"], [], False),
        ("Mix", ["latents", "noise"], ["noisy"], [], True),
        sink=(["noisy"], ["dit"]),
    )
    good = ug.split(p, lora_base_model="dit")

    def tampered(**changes):
        plan = ug.Plan.from_dict(good.to_dict())
        for key, value in changes.items():
            setattr(plan, key, value)
        return [line.split(":")[0] for line in ug.verify(p, plan)]

    assert tampered() == []
    assert "C1" in tampered(train_units=["Noise"], data_process_units=["Encode", "Mix"])
    assert "seeds" in tampered(train_units=["Mix"], data_process_units=["Encode", "Noise"])
    assert set(tampered(cache_entries=[("latents", "Encode")])) == {"cache", "equivalence"}
    assert "cache" in tampered(cache_entries=good.cache_entries + [("image", None)])
    assert tampered(train_models=["dit", "vae"]) == ["models"]
    assert tampered(fingerprint="sha256:0") == ["fingerprint"]
    assert "partition" in tampered(data_process_units=["Encode", "Ghost"])
    assert "partition" in tampered(train_units=["Mix", "Noise"])


def test_networkx_view_carries_params_and_update_chains():
    p = pipeline(
        ("Encode", ["image"], ["x"], ["vae"], True),
        ("Refine", ["x"], ["x", "y"], [], True),
        ("Overwrite", ["z"], ["x"], [], True),
        ("Read", ["x", "y"], ["out"], [], True),
    )
    g = VersionGraph.of(p).to_networkx()
    assert [g.nodes[i]["name"] for i in g.nodes] == ["Encode", "Refine", "Overwrite", "Read"]
    assert g.edges[0, 1] == {"params": ["x"], "kind": "data", "chain": ["x"]}
    assert g.edges[1, 3]["params"] == ["y"] and g.edges[1, 3]["kind"] == "data"
    assert g.edges[2, 3]["params"] == ["x"]
    assert g.edges[1, 2] == {"params": [], "chain": ["x"], "kind": "chain"}  # successive writers of x
    assert not g.has_edge(0, 3), "Read takes x from Overwrite, not from Encode"
