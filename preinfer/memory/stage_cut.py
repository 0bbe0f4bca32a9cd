"""Pipeline stages: the model's layers cut into contiguous ranges, one per pipeline rank, the embedding on the
first and the head on the last, balanced by the planner's memory model (`preinfer.memory.footprint`).

A stage's cost is its worst visit: its weights, the gradients and optimizer state of the part of the active
block it holds, and the activations of the micro-batches it keeps in flight (GPipe: all M; 1F1B: at most
N - j on stage j of N). The cut minimises the largest stage's cost over every contiguous cut (dynamic
programming), so it never needs more than the parameter-balanced cut the planner's pipeline degree assumes.
"""

from __future__ import annotations

from dataclasses import replace

from preinfer.errors import UsageError
from preinfer.memory.footprint import Memory, block_text, distinct_visits, stage_bytes, stage_memory
from preinfer.memory.layer_spans import LayerSpan
from preinfer.memory.settings import Settings
from preinfer.memory.shapes import ModelShape
from preinfer.partition import minimax_cut

PIPELINE_SCHEDULES = ("1f1b", "gpipe")


def in_flight(schedule: str, stage: int, degree: int, microbatches: int) -> int:
    """Micro-batches whose activations stage `stage` of `degree` holds at once under `schedule`."""
    return microbatches if schedule == "gpipe" else min(microbatches, degree - stage)


def stage_cost(m: ModelShape, settings: Settings, stage: LayerSpan, index: int, degree: int,
               blocks: list[LayerSpan], microbatches: int, schedule: str) -> int:
    """Peak bytes of stage `index` over every visit of `blocks`."""
    flight = in_flight(schedule, index, degree, microbatches)
    return max(stage_bytes(m, settings, stage, active, flight) for active in distinct_visits(stage, blocks))


def cut_stages(m: ModelShape, settings: Settings, degree: int, blocks: list[LayerSpan], microbatches: int,
                schedule: str = "1f1b", first: int = 0) -> list[LayerSpan]:
    """`degree` contiguous stages of layers `[first, L)` (a store's suffix when `first` > 0: no embedding) whose
    largest peak (by `stage_cost`) is the smallest possible."""
    if degree > m.layers - first:
        above = f"the {m.layers - first} layers above the store's boundary {first}" if first else \
            f"the model's {m.layers} layers"
        raise UsageError(f"--pipeline {degree}: more stages than {above}")
    if schedule not in PIPELINE_SCHEDULES:
        raise UsageError(f"--pipeline-schedule {schedule!r} is not one of {', '.join(PIPELINE_SCHEDULES)}")
    layers = m.layers - first

    def cost(index: int, lo: int, hi: int) -> int:
        stage = LayerSpan(first + lo, first + hi, index == 0 and first == 0, index == degree - 1)
        return stage_cost(m, settings, stage, index, degree, blocks, microbatches, schedule)

    bounds = minimax_cut(layers, degree, cost)
    return [LayerSpan(first + lo, first + hi, j == 0 and first == 0, j == degree - 1)
            for j, (lo, hi) in enumerate(bounds)]


def stage_rows(m: ModelShape, settings: Settings, degree: int, blocks: list[LayerSpan],
               schedule: str = "1f1b") -> tuple[dict[str, Memory], list[LayerSpan]]:
    """The plan's memory rows on a pipeline of `degree` (`degree` micro-batches a step, as the plan's run line
    gives), each the worst stage priced as its own card, and the stages of BCD's cut (`cut_stages`, as the run cuts
    them). Full Adam's stages are cut for its one visit of every parameter; from a store, block 0 is left out."""
    rows = {}
    for name, recompute in (("full_adam", False), ("full_adam_recompute", True)):
        full = replace(settings, recompute=recompute)
        rows[name] = worst_stage(m, full, cut_stages(m, full, degree, [None], degree, schedule), [None], schedule)
    stages = cut_stages(m, settings, degree, blocks, degree, schedule)
    rows["bcd_live"] = worst_stage(m, settings, stages, blocks, schedule)
    rows["bcd_store"] = worst_stage(m, settings, stages, blocks, schedule, first_visit=1 if len(blocks) > 1 else 0)
    return rows, stages


def worst_stage(m: ModelShape, settings: Settings, stages: list[LayerSpan], visits: list[LayerSpan | None],
                schedule: str, first_visit: int = 0) -> Memory:
    """The largest of `stages`' memories over the visits `visits[first_visit:]` (None: full Adam), each stage
    keeping as many micro-batches in flight as `schedule` does with one a stage per step."""
    degree, worst = len(stages), None
    for j, stage in enumerate(stages):
        flight = in_flight(schedule, j, degree, degree)
        for k, active in enumerate(visits[first_visit:], first_visit):
            memory = stage_memory(m, settings, stage, active, flight)
            if worst is None or memory.total > worst.total:
                block = "" if active is None else f", block {k} ({block_text(active)})"
                worst, memory.note = memory, f"stage {j} of {degree} ({stage_label(stage)}){block}"
    return worst


def stage_label(stage: LayerSpan) -> str:
    """`embed+layers 0-1`, `layers 2-3+head`."""
    span = f"layer {stage.start}" if stage.stop - stage.start == 1 else f"layers {stage.start}-{stage.stop - 1}"
    return "+".join((["embed"] if stage.embed else []) + [span] + (["head"] if stage.head else []))


def describe_stages(stages: list[LayerSpan], peaks: list[int], replicas: int, microbatches: int,
                    schedule: str) -> str:
    """The stages as printed at the start of a pipeline run."""
    lines = [f"pipeline: {len(stages)} stages x {replicas} data-parallel replica(s), {schedule} schedule, "
             f"{microbatches} micro-batches per step; stages balanced by the planner's memory model:"]
    lines += [f"  stage {j}: {stage_label(stage):<24} predicted peak {peak / 2**20:.2f} MiB"
              for j, (stage, peak) in enumerate(zip(stages, peaks))]
    return "\n".join(lines)
