"""The hazard report (`unitgraph audit`): was a split by the update-chain rule alone sound?

DiffSynth-Studio's own split moves a unit to training by the update-chain rule U: it misses
write-after-read and write-after-write hazards, which the write-hazard rule W closes
(docs/semantics.md, 'Why W and not only U'). For every model a user could train (each model
alone, with the denoiser as the LoRA base), the audit compares three splits of the active pipeline:

- `update-chain`: the least fixed point of X ∪ F(X) ∪ U(X) (`closure.update_chain_train_set`),
  simulated with the verifier's version tags to show the reads it gets wrong;
- `latest` and `versioned`: the splits unitgraph plans, with the models stage 2 loads and the cache
  entries each needs.

A hazard is a unit W moves to training that U does not, because it writes a param after a training
unit read it (write-after-read) or wrote it (write-after-write); units that follow it into training
(F) are listed with it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable

from .closure import LATEST, VERSIONED, backward_models, train_set, update_chain_train_set
from .entries import cache_entries
from .graph import VersionGraph
from .plan import split
from .prune import prune
from .spec import Pipeline
from .soundness import MISSING, split_reads, unsplit_reads

FORMAT = "unitgraph.audit/v1"
DENOISER_NAMES = ("dit", "transformer", "unet", "denoiser", "transformer_2")
SINK = "sink"


@dataclass(frozen=True)
class Hazard:
    """`unit` writes `param` after training unit `conflicts_with` read (or wrote) it."""

    unit: str
    param: str
    conflicts_with: str
    kind: str  # "write-after-read" or "write-after-write"

    def describe(self) -> str:
        verb = "read" if self.kind == "write-after-read" else "wrote"
        return f"{self.unit} writes {self.param} after {self.conflicts_with} {verb} it ({self.kind})"


@dataclass(frozen=True)
class WrongRead:
    """Under the update-chain split, `reader` reads `param` as `got`; unsplit it reads `want`.

    Versions are writer unit names; None is the dataset value, MISSING a value nothing provides.
    """

    reader: str
    param: str
    got: str | None
    want: str | None

    def describe(self) -> str:
        return f"{self.reader} reads {self.param} as {_version(self.got)}; unsplit it reads {_version(self.want)}"


def _version(tag: str | None) -> str:
    if tag == MISSING:
        return "nothing (not cached)"
    return "the dataset value" if tag is None else f"the version written by {tag}"


@dataclass
class SplitSummary:
    """One split of a case: its stage-2 units and models and its cache entries."""

    rule: str  # "update-chain", "latest" or "versioned"
    train_units: list[str]
    train_models: list[str]
    cache_entries: list[tuple[str, str | None]]
    sound: bool = True

    def to_dict(self) -> dict[str, Any]:
        return {
            "train_units": list(self.train_units),
            "train_models": list(self.train_models),
            "cache_entries": [{"param": p, "writer": w} for p, w in self.cache_entries],
            "sound": self.sound,
        }


@dataclass
class AuditCase:
    """One configuration: `trainable_models` trained (LoRA on `lora_base_model`)."""

    trainable_models: list[str]
    lora_base_model: str | None
    models_require_backward: list[str]
    hazards: list[Hazard]
    pulled_along: list[tuple[str, str]]  # (unit, why) moved to training by a hazard's consequences
    wrong_reads: list[WrongRead]
    update_chain: SplitSummary
    latest: SplitSummary
    versioned: SplitSummary

    @property
    def title(self) -> str:
        trained = " + ".join(self.trainable_models)
        lora = f"LoRA on {self.lora_base_model}" if self.lora_base_model else ""
        if trained and lora:
            return f"train {trained}, {lora}"
        return f"train {trained}" if trained else lora or "nothing trained"

    def to_dict(self) -> dict[str, Any]:
        return {
            "trainable_models": list(self.trainable_models),
            "lora_base_model": self.lora_base_model,
            "models_require_backward": list(self.models_require_backward),
            "missed_hazards": [h.__dict__ for h in self.hazards],
            "pulled_along": [{"unit": u, "why": why} for u, why in self.pulled_along],
            "wrong_reads_update_chain": [
                {"reader": r.reader, "param": r.param, "reads": r.got, "should_read": r.want} for r in self.wrong_reads
            ],
            "update_chain": self.update_chain.to_dict(),
            "latest": self.latest.to_dict(),
            "versioned": self.versioned.to_dict(),
        }


@dataclass
class Audit:
    pipeline: str
    lora_base_model: str | None
    provided: list[str] | None
    inactive_units: list[str]
    cases: list[AuditCase] = field(default_factory=list)

    @property
    def cases_with_hazards(self) -> list[AuditCase]:
        return [c for c in self.cases if c.hazards]

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "pipeline": self.pipeline,
            "lora_base_model": self.lora_base_model,
            "provided": self.provided,
            "inactive_units": list(self.inactive_units),
            "cases_with_missed_hazards": len(self.cases_with_hazards),
            "cases": [c.to_dict() for c in self.cases],
        }


def denoiser_of(pipeline: Pipeline) -> str | None:
    """The LoRA base the audit assumes: the sink's denoiser (dit, transformer, unet, ...) or its only model."""
    if pipeline.sink is None or not pipeline.sink.models:
        return None
    for name in DENOISER_NAMES:
        if name in pipeline.sink.models:
            return name
    return pipeline.sink.models[0]


def audit(
    pipeline: Pipeline,
    *,
    lora_base_model: str | None = None,
    provided: Iterable[str] | None = None,
    models: Iterable[str] | None = None,
) -> Audit:
    """Audit every trainable model of `pipeline` (or `models`), each alone with the LoRA base.

    `lora_base_model` defaults to the sink's denoiser; `provided` prunes optional units first.
    """
    provided_list = None if provided is None else sorted(set(provided))
    active, inactive = prune(pipeline, provided_list)
    base = lora_base_model if lora_base_model is not None else denoiser_of(active)
    candidates = sorted(set(models) if models is not None else set(active.models))
    configs: list[list[str]] = []
    if base is not None:
        configs.append([])
    configs += [[m] for m in candidates if m != base]
    result = Audit(active.name, base, provided_list, inactive)
    for trained in configs:
        result.cases.append(_case(pipeline, active, trained, base, provided_list))
    return result


def _case(pipeline: Pipeline, active: Pipeline, trained: list[str], base: str | None,
          provided: list[str] | None) -> AuditCase:
    vg = VersionGraph.of(active)
    names = vg.names
    backward = backward_models(trained, base)
    latest = split(pipeline, trained, base, LATEST, provided)
    versioned = split(pipeline, trained, base, VERSIONED, provided)
    reasons = train_set(vg, backward, LATEST)
    u_train = update_chain_train_set(vg, backward)

    hazards, pulled = [], []
    for i in sorted(set(reasons) - u_train):
        reason = reasons[i]
        if reason.rule == "W":
            kind = "write-after-read" if reason.access == "reads" else "write-after-write"
            hazards.append(Hazard(names[i], reason.param, names[reason.via], kind))
        else:
            pulled.append((names[i], reason.describe(names)))

    u_entries = cache_entries(vg, u_train, LATEST)
    expected = unsplit_reads(vg)
    actual = split_reads(vg, u_train, u_entries, LATEST)
    wrong = []
    for (reader, param), want in expected.items():
        got = actual.get((reader, param), MISSING)
        if got != want:
            wrong.append(WrongRead(SINK if reader == vg.n else names[reader], param, _tag(names, got), _tag(names, want)))

    units = active.units
    u_models = sorted({m for i in u_train for m in units[i].models} | set(backward) | set(vg.sink_models(backward)))
    update_chain = SplitSummary(
        "update-chain",
        [names[i] for i in sorted(u_train)],
        u_models,
        [(p, None if w is None else names[w]) for p, w in u_entries],
        sound=not wrong,
    )
    return AuditCase(
        trainable_models=list(trained),
        lora_base_model=base,
        models_require_backward=sorted(backward),
        hazards=hazards,
        pulled_along=pulled,
        wrong_reads=wrong,
        update_chain=update_chain,
        latest=_summary("latest", latest),
        versioned=_summary("versioned", versioned),
    )


def _tag(names: list[str], tag: Any) -> str | None:
    if tag is None or tag == MISSING:
        return tag
    return names[tag]


def _summary(rule: str, plan) -> SplitSummary:
    return SplitSummary(rule, list(plan.train_units), list(plan.train_models), list(plan.cache_entries),
                        sound=plan.checks_pass)


# --- text -----------------------------------------------------------------------------------------


def text_renderables(result: Audit) -> list[Any]:
    """Rich renderables: a summary line, then per configuration its hazards and the three splits."""
    from rich.table import Table
    from rich.text import Text

    out: list[Any] = []
    head = Text()
    head.append(f"audit of {result.pipeline}", style="bold")
    head.append(f" · LoRA base {result.lora_base_model or 'none'} · {len(result.cases)} configurations · ")
    missed = len(result.cases_with_hazards)
    head.append(f"{missed} with hazards the update-chain rule misses", style="bold red" if missed else "green")
    out.append(head)
    if result.provided is not None:
        inactive = ", ".join(result.inactive_units) or "none"
        out.append(Text(f"dataset provides: {', '.join(result.provided) or 'nothing'}; inactive units: {inactive}",
                        style="dim"))

    for case in result.cases:
        out.append(Text(""))
        out.append(Text(f"── {case.title} ──", style="bold"))
        if case.hazards:
            lines = Text()
            count = len(case.hazards)
            lines.append(f"the update-chain rule (DiffSynth-Studio's split) misses {count} "
                         f"hazard{'s' if count != 1 else ''}:\n", style="red")
            for hazard in case.hazards:
                lines.append(f"  • {hazard.describe()}\n")
            for unit, why in case.pulled_along:
                lines.append(f"  ↳ {unit} follows: it {why}\n", style="dim")
            if case.wrong_reads:
                lines.append("with the update-chain split, stage 2 would read wrong versions:\n", style="red")
                for read in case.wrong_reads:
                    lines.append(f"  ✗ {read.describe()}\n")
            else:
                lines.append("no read goes wrong with the update-chain split here (nothing reads the overwritten "
                             "version later), but its cache no longer holds the last stage-1 value\n", style="dim")
            lines.rstrip()
            out.append(lines)
        else:
            out.append(Text("no hazard the update-chain rule misses: its split is the latest split", style="green"))

        table = Table.grid(padding=(0, 2))
        table.add_column("split", no_wrap=True, style="bold")
        table.add_column("details", ratio=1)
        rows: list[tuple[str, SplitSummary]] = []
        if case.hazards:
            rows.append(("update-chain ✗ unsound" if not case.update_chain.sound else "update-chain", case.update_chain))
        if _same(case.latest, case.versioned):
            rows.append(("latest = versioned", case.latest))
        else:
            rows += [("latest", case.latest), ("versioned", case.versioned)]
        for label, summary in rows:
            body = Text()
            body.append("stage 2 loads: ", style="dim")
            body.append(", ".join(summary.train_models) or "nothing")
            body.append("\ntrain units: ", style="dim")
            body.append(", ".join(summary.train_units) or "none")
            body.append(f"\ncache entries ({len(summary.cache_entries)}): ", style="dim")
            body.append(", ".join(f"{p}←{w or 'dataset'}" for p, w in summary.cache_entries) or "none")
            table.add_row(label, body)
        out.append(table)
        saved = sorted(set(case.latest.train_models) - set(case.versioned.train_models))
        if saved:
            out.append(Text(f"versioned keeps {', '.join(saved)} out of stage 2", style="yellow"))
    return out


def _same(a: SplitSummary, b: SplitSummary) -> bool:
    return (a.train_units, a.train_models, a.cache_entries) == (b.train_units, b.train_models, b.cache_entries)


def render_text(result: Audit, width: int = 120) -> str:
    import io

    from rich.console import Console

    buffer = io.StringIO()
    console = Console(file=buffer, width=width, color_system=None, force_terminal=False, highlight=False,
                      emoji=False, soft_wrap=False)
    for item in text_renderables(result):
        console.print(item)
    return buffer.getvalue()


__all__ = ["Audit", "AuditCase", "Hazard", "SplitSummary", "WrongRead", "audit", "denoiser_of", "render_text",
           "text_renderables"]
