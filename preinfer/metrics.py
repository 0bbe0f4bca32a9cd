"""The run's metrics log (JSON lines, one record per line) and its loss plot.

Every record kind is one dataclass below; `to_dict` gives its JSON object (with `"kind"` first) and
`parse_record` reads one back. docs/reference/metrics.md, generated from these classes (a field's comment is its
description), documents the kinds for users who parse the file.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, ClassVar, TextIO

from preinfer.atomic_write import write_atomically
from preinfer.errors import PreinferError


@dataclass
class Record:
    """A metrics.jsonl record; a field named with a trailing underscore (a Python keyword) drops it in JSON,
    and an optional field that is None is left out."""

    kind: ClassVar[str]

    def to_dict(self) -> dict[str, Any]:
        values = {f.name.rstrip("_"): getattr(self, f.name) for f in fields(self)}
        return {"kind": self.kind, **{key: value for key, value in values.items() if value is not None}}


@dataclass
class StepRecord(Record):
    """One optimizer step of a visit."""

    kind: ClassVar[str] = "step"
    sweep: int  # the sweep, from 0
    block: int  # the active block's index
    step: int  # steps of the run so far, this one included
    visit_step: int  # steps of this visit so far, this one included
    loss: float  # mean loss over the step's supervised tokens (all micro-batches, all ranks)
    lr: float  # the learning rate of this step
    tokens: int  # real (unpadded) tokens trained on by this rank so far
    tokens_per_s: float  # this step's tokens over its wall time
    wait_s: float  # time spent waiting for the step's batches
    visit_s: float | None = None  # seconds since the visit began, at this step's end (windows of throughput)
    time: float | None = None  # Unix time at this step's end (lines steps up with other processes' clocks)
    loss_scale: float | None = None  # fp16-mixed: the loss scale after this step
    skipped_steps: int | None = None  # fp16-mixed: steps of the run skipped so far for non-finite gradients
    sent_bytes: int | None = None  # data parallel: bytes this rank sent in the step's collectives (preinfer.wire)


@dataclass
class VisitRecord(Record):
    """A finished visit of one block (also kept in the checkpoint and summary.json). `memory` holds the meter's
    peaks over the visit's first 2 steps: params, frozen_device (streamed frozen layers on the device), masters
    (mixed precision's fp32 copies), grads, optimizer,
    activations, tracked_peak, rss_peak, cuda_peak; with --keep-optimizer-state also host_optimizer, the bytes of
    the kept optimizer states in host memory after the visit."""

    kind: ClassVar[str] = "visit"
    sweep: int  # the sweep, from 0
    block: int  # the block's index
    label: str  # the block's parts, e.g. "embed+layers 0-1"
    steps: int  # optimizer steps of the visit
    stop_reason: str  # what ended the visit: steps (a step or epoch budget), plateau, gain or total-steps (the run's)
    eval_loss: float  # mean loss over the eval split after the visit
    wall_s: float  # the visit's training time (data parallel: its closing sync included)
    tokens: int  # as in the step records, at the end of the visit
    source_boundary: int  # 0: token batches (prefix run live); k > 0: trained from a store at boundary k
    lr: float | None = None  # the visit's full learning rate: --lr times the block's --block-lr factor
    expand: str | None = None  # what expanded the layers above the block: lowrank or sgd (auto resolved); None: none
    memory: dict[str, int] = field(default_factory=dict)  # the memory meter's peaks in bytes; {} without a meter
    eval_s: float = 0.0  # time of the evaluation after the visit (not in wall_s)
    ranks: list[dict] | None = None  # pipeline runs: each rank's `rank`, `stage`, `replica` and memory peaks
    sent_bytes: int | None = None  # data parallel: bytes this rank sent in the visit, its closing sync included
    # --stop gain, at the visit's last step: window, rate and initial_rate (loss decrease per second), horizon_s,
    # and by other block: ratios (score over the active block's), switch_s, predicted (rates); best (block or null)
    gain: dict | None = None


@dataclass
class ImportanceRecord(Record):
    """An importance order's sweep: the blocks' scores, measured at the sweep's start, and the visits they chose."""

    kind: ClassVar[str] = "importance"
    sweep: int  # the sweep, from 0
    scores: list[float]  # per block: the root mean square of its gradient per parameter and batch
    order: list[int]  # the blocks the sweep visits, in order
    chosen: str  # importance (descending score) or ascending (importance-cached, the scores within the margin)
    spread: float  # (max - min) / max of the visited blocks' scores
    due: list[int]  # blocks visited because --importance-floor made them due
    batches: int  # training batches measured
    seconds: float  # the measurement's time (forward and backward through every block per batch)

    def line(self) -> str:
        scores = ", ".join(f"{score:.3g}" for score in self.scores)
        due = f"; due by the floor: {', '.join(map(str, self.due))}" if self.due else ""
        return (f"sweep {self.sweep} block scores {scores} (gradient norm per parameter, {self.batches} batches, "
                f"{self.seconds:.1f} s): visits {' '.join(map(str, self.order))} in {self.chosen} order (spread "
                f"{self.spread:.2f}){due}")


@dataclass
class CacheRecord(Record):
    """Pre-inference made, reused or deleted a store of boundary states."""

    kind: ClassVar[str] = "cache"
    boundary: int  # the store's boundary: the layer its states feed
    how: str  # input (a fresh prefix run), roll_forward, reuse, deleted, or probe (auto's timing of the disk)
    seconds: float  # time taken: to make it, to delete it, or the whole probe; 0 for reuse
    bytes: int  # input and roll_forward: the store's bytes on disk (every rank's shards); probe: bytes written
    from_: int | None = None  # input and roll_forward: the boundary the store was made from (0: the input)
    reason: str | None = None  # deleted: why the store was no longer usable


@dataclass
class PreInferenceRecord(Record):
    """One visit's part of the sweep plan (`auto` or `on`), with its estimates (seconds, bytes)."""

    kind: ClassVar[str] = "pre_inference"
    block: int  # the visit's block
    boundary: int  # the block's first layer: the boundary a store would hold
    decision: str  # store or live
    steps: int  # expected steps of the visit
    prefix_per_step: float  # the prefix forward a store saves per step
    read_per_step: float  # reading a step's states from the store
    eval_prefix: float  # the prefix forward the visit's evaluation saves
    build: float  # making the store (0 when a valid one exists)
    build_from: int  # the boundary it would be made from (0: the input)
    store_bytes: int  # the store's expected size
    free_bytes: int  # free disk where the stores go
    saving_s: float  # this visit's saving from its store, build included (the sweep plan may still pay overall)


@dataclass
class SweepPlanRecord(Record):
    """Pre-inference's plan for a sweep (or for the rest of it, when revised), against its alternative."""

    kind: ClassVar[str] = "sweep_plan"
    sweep: int  # sweeps planned by this process so far, from 0
    reason: str  # "sweep start", "resumed mid-sweep" or "revised: <rate> <assumed> -> <measured>, ..."
    mode: str  # auto or on
    first_visit: int  # the sweep's visit the plan starts at
    chosen: str  # "live" or the stores it reads and how each is made
    predicted_s: float  # the chosen plan's seconds
    alternative: str  # auto: the other plan ("live", or the cheapest plan that reads stores), or why there is none
    live_s: float  # the all-live plan
    sources: list[int]  # per visit from first_visit: the boundary read, 0 live
    builds: list[dict]  # per store made: boundary, from (0: the input), before_visit, seconds
    peak_bytes: int  # new store bytes on disk at the plan's peak
    free_bytes: int  # free disk where the stores go
    layer_seconds: float  # the throughputs assumed: one layer's forward over one sample (live and evaluation)
    write_bps: float  # store bytes written per second
    read_bps: float  # store bytes read per second
    store_overhead_s: float  # making one store beyond its forward and bytes
    alternative_s: float | None = None  # None: no alternative
    note: str | None = None  # said once: the order gives stores no reuse
    build_layer_seconds: float | None = None  # one layer's forward over one sample inside a store's build

    def line(self) -> str:
        alternative = "" if self.alternative_s is None else f" {self.alternative_s:.1f} s"
        text = (f"sweep {self.sweep} pre-inference plan ({self.reason}): {self.chosen}, predicted "
                f"{self.predicted_s:.1f} s; alternative {self.alternative}{alternative}; live {self.live_s:.1f} s; "
                f"peak disk {self.peak_bytes / 2**20:.1f} MiB of {self.free_bytes / 2**30:.1f} GiB free; "
                f"assumed layer {1e3 * self.layer_seconds:.3g} ms/sample"
                + ("" if self.build_layer_seconds is None else f" ({1e3 * self.build_layer_seconds:.3g} building)")
                + f", write {self.write_bps / 1e6:,.1f} MB/s, read {self.read_bps / 1e6:,.1f} MB/s")
        return text if self.note is None else f"{text}\n{self.note}"


@dataclass
class PlanOutcomeRecord(Record):
    """At the end of a sweep: the plans' predicted seconds against the measured ones (visits and store builds)."""

    kind: ClassVar[str] = "plan_outcome"
    sweep: int  # as in sweep_plan
    predicted_s: float  # this sweep
    measured_s: float  # this sweep
    run_predicted_s: float  # every sweep so far
    run_measured_s: float  # every sweep so far

    def line(self) -> str:
        error = self.run_predicted_s / self.run_measured_s - 1 if self.run_measured_s else 0.0
        return (f"sweep {self.sweep} pre-inference: predicted {self.predicted_s:.1f} s, measured "
                f"{self.measured_s:.1f} s; run so far {self.run_predicted_s:.1f} s predicted, "
                f"{self.run_measured_s:.1f} s measured ({100 * error:+.0f}%)")


@dataclass
class BudgetPlanRecord(Record):
    """The blocks `--ufp auto` chose under a memory budget, by the planner of `preinfer plan` (bytes); written at
    the start of the run, and again on --resume."""

    kind: ClassVar[str] = "budget_plan"
    budget: int  # bytes each visit may fill
    blocks: int  # blocks of layers (as --blocks counts them) of the fewest visits that fit
    predicted: list[int]  # the planner's peak of each block's visit, live
    precision: str  # the run's precision the plan priced
    recompute: bool  # whether the plan priced recomputation
    seq_len: int  # tokens per sample
    micro_batch: int  # samples per micro-batch (--batch-size)
    separate_ends: bool = False  # the embedding and the head in blocks of their own (chosen, or asked for)


@dataclass
class ResolvedRecord(Record):
    """The run's config with every auto settled (`preinfer.config.resolved.ResolvedRun`), as `preinfer plan --json`
    shows it under `resolved`; written at the start of the run, and again on --resume."""

    kind: ClassVar[str] = "resolved"
    precision: str  # fp32, bf16-mixed or fp16-mixed (auto follows the model's weights)
    expand: str  # the landscape expansion: none, lowrank or sgd
    frozen_dtype: str  # the frozen linear weights' dtype: the resident one, or bf16, int8, nf4
    store_dtype: str  # the dtype the stores hold boundary states in
    blocks: int  # blocks of the partition


@dataclass
class ResumeRecord(Record):
    """A run resumed from its checkpoint, and the config keys the resuming command changed."""

    kind: ClassVar[str] = "resume"
    step: int  # the checkpoint's step: the run continues after it
    changed: dict[str, list] = field(default_factory=dict)  # "section.key": [before, after] (RESUMABLE_KEYS only)


RECORD_KINDS: dict[str, type[Record]] = {cls.kind: cls for cls in (StepRecord, VisitRecord, CacheRecord,
                                                                   PreInferenceRecord, BudgetPlanRecord,
                                                                   SweepPlanRecord, PlanOutcomeRecord,
                                                                   ResumeRecord, ImportanceRecord, ResolvedRecord)}


def parse_record(data: dict[str, Any]) -> Record:
    """The record a JSON object stands for; unknown kinds and missing fields are refused."""
    cls = RECORD_KINDS.get(data.get("kind"))
    if cls is None:
        raise PreinferError(f"unknown metrics record kind {data.get('kind')!r} (known: {', '.join(RECORD_KINDS)})")
    names = {f.name.rstrip("_"): f.name for f in fields(cls)}
    try:
        return cls(**{names[key]: value for key, value in data.items() if key in names})
    except TypeError as error:
        raise PreinferError(f"metrics record of kind {cls.kind!r}: {error}") from None


class MetricsLog:
    """Appends one JSON object per line, flushed as written; a None path discards (non-zero ranks, tests). The
    file and its directory are created by the first record; the file stays open until `close()` (a later record
    opens it again), so a step's record costs one write, not an open and a close."""

    def __init__(self, path: Path | None):
        self.path = path
        self._file: TextIO | None = None

    def write(self, record: Record) -> None:
        if self.path is None:
            return
        if self._file is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = self.path.open("a")
        self._file.write(json.dumps(record.to_dict()) + "\n")
        self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def rewind(self, step: int, visits: int) -> None:
        """Drop what a killed run logged after its checkpoint (at `step`, with `visits` finished visits): the step
        records after `step`, the visit records after the first `visits`, and a last line cut short; the
        resumed run logs them again."""
        if self.path is None or not self.path.is_file():
            return
        self.close()
        kept, seen = [], 0
        for line in self.path.read_text().splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            seen += record.get("kind") == "visit"
            if record.get("kind") == "step" and record.get("step", 0) > step or (
                    record.get("kind") == "visit" and seen > visits):
                continue
            kept.append(line + "\n")
        write_atomically(self.path, "".join(kept))


def read_metrics(path: Path) -> list[Record]:
    records = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip():
            try:
                records.append(parse_record(json.loads(line)))
            except (PreinferError, json.JSONDecodeError) as error:
                raise PreinferError(f"{path}, line {number}: {error}") from None
    return records


def plot_losses(runs: dict[str, list[Record]], out: Path, title: str = "") -> None:
    """Training loss (smoothed) and eval loss against tokens, one colour per run; the first run's visits are
    shaded by block."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5))
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for index, (name, records) in enumerate(runs.items()):
        colour = colours[index % len(colours)]
        steps = [r for r in records if isinstance(r, StepRecord)]
        visits = [r for r in records if isinstance(r, VisitRecord)]
        if index == 0:
            _shade_visits(ax, steps, colours)
        ax.plot([r.tokens for r in steps], _smooth([r.loss for r in steps]), color=colour, alpha=0.8,
                label=f"{name}: training loss (smoothed)")
        ax.plot([r.tokens for r in visits], [r.eval_loss for r in visits], "o--", color=colour,
                label=f"{name}: eval loss after each visit")
    ax.set_xlabel("tokens")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title(title or "BCD training", pad=14)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def _shade_visits(ax, steps: list[StepRecord], colours: list[str]) -> None:
    start = 0
    for i, r in enumerate(steps):
        last = i + 1 == len(steps) or steps[i + 1].block != r.block or steps[i + 1].sweep != r.sweep
        if last:
            lo = steps[start - 1].tokens if start else 0
            ax.axvspan(lo, r.tokens, color=colours[r.block % len(colours)], alpha=0.08, lw=0)
            ax.text((lo + r.tokens) / 2, 1.0, f"b{r.block}", transform=ax.get_xaxis_transform(),
                    ha="center", va="bottom", fontsize=7)
            start = i + 1


def _smooth(values: list[float], weight: float = 0.9) -> list[float]:
    out, current = [], None
    for v in values:
        current = v if current is None else weight * current + (1 - weight) * v
        out.append(current)
    return out
