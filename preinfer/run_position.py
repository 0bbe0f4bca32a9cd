"""Where a run stands (`RunPosition`, saved in every checkpoint as state.json's `trainer`), and the records of its
steps and visits."""

from __future__ import annotations

import time
from dataclasses import dataclass, field, fields

from preinfer.errors import CheckpointError
from preinfer.metrics import StepRecord, VisitRecord
from preinfer.partition import Block


@dataclass
class RunPosition:
    """Where a run stands; saved in every checkpoint so that a resumed run continues bit for bit."""

    sweep: int = 0
    visit: int = 0  # index into the current sweep's order
    visit_step: int = 0
    global_step: int = 0
    tokens: int = 0
    cursor: dict | None = None  # the training source's state_dict; None: the start of the data
    stop: dict | None = None
    visits: list[dict] = field(default_factory=list)  # each finished visit's VisitRecord.to_dict()
    loss_scaler: dict | None = None  # fp16-mixed: the LossScaler's state (GradScaler's, and the skipped steps)
    experts: dict[str, dict[str, list[int]]] = field(default_factory=dict)  # block -> layer -> its chosen experts
    sweep_order: dict | None = None  # importance orders: the sweep's ImportanceRecord (scores, visits), as measured
    gain: dict | None = None  # --stop gain: the visit's GainRule state

    @classmethod
    def from_state(cls, state: object, source: str, sweeps: int, visits_per_sweep: int) -> RunPosition:
        """The position a checkpoint saved, each field checked (its type, and the sweep and visit within the
        run's `sweeps` and `visits_per_sweep`); a bad one is a CheckpointError naming it."""
        if not isinstance(state, dict):
            raise CheckpointError(f"{source}: trainer: expected a JSON object, got {type(state).__name__}")
        known = {f.name for f in fields(cls)}
        for key, value in state.items():
            if key not in known:
                raise CheckpointError(f"{source}: trainer.{key}: not a field of the trainer's run position")
            kind, expected = POSITION_FIELDS[key]
            if not isinstance(value, kind) or isinstance(value, bool):
                raise CheckpointError(f"{source}: trainer.{key} = {value!r:.60}: expected {expected}")
        limits = {"sweep": sweeps, "visit": visits_per_sweep}
        for key in ("sweep", "visit", "visit_step", "global_step", "tokens"):
            value = state.get(key, 0)
            if not 0 <= value <= limits.get(key, value):
                bound = f" at most {limits[key]}" if key in limits else ""
                raise CheckpointError(f"{source}: trainer.{key} = {value}: expected an integer >= 0{bound}")
        return cls(**state)

    def step_record(self, block: Block, loss: float, lr: float, tokens: int, timings: dict, started: float,
                    scaler: dict) -> StepRecord:
        """The record of the step just counted (`tokens`: its own; `started`: the visit's start)."""
        return StepRecord(
            sweep=self.sweep, block=block.index, step=self.global_step, visit_step=self.visit_step, loss=loss,
            lr=lr, tokens=self.tokens, tokens_per_s=tokens / max(timings["step_s"], 1e-9), wait_s=timings["wait_s"],
            visit_s=time.perf_counter() - started, time=time.time(), **scaler,
        )

    def visit_record(self, block: Block, steps: int, reason: str, eval_loss: float, wall: float, boundary: int,
                     memory: dict, eval_s: float, gain: dict | None, lr: float | None = None,
                     expand: str | None = None) -> VisitRecord:
        """The record of the visit just finished (`lr`: its full rate; `expand`: its suffix's expansion)."""
        return VisitRecord(
            sweep=self.sweep, block=block.index, label=block.label, steps=steps, stop_reason=reason,
            eval_loss=eval_loss, wall_s=wall, tokens=self.tokens, source_boundary=boundary, lr=lr, memory=memory,
            eval_s=eval_s, gain=gain, expand=expand,
        )


# Each RunPosition field's JSON type, and how a message names it.
_DICT_OR_NONE = ((dict, type(None)), "an object or null")
POSITION_FIELDS = {
    **{key: (int, "an integer") for key in ("sweep", "visit", "visit_step", "global_step", "tokens")},
    "cursor": _DICT_OR_NONE, "stop": _DICT_OR_NONE, "loss_scaler": _DICT_OR_NONE, "sweep_order": _DICT_OR_NONE,
    "gain": _DICT_OR_NONE,
    "visits": (list, "a list of visit records"), "experts": (dict, "an object"),
}
