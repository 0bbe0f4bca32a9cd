"""The progress display of a run: a tqdm bar per visit and one line per finished visit, store and plan."""

from __future__ import annotations

from tqdm import tqdm

from preinfer.memory.budget import budget_line, visit_against_budget
from preinfer.config import Config
from preinfer.metrics import (
    BudgetPlanRecord, CacheRecord, ImportanceRecord, PlanOutcomeRecord, PreInferenceRecord, Record, ResumeRecord,
    SweepPlanRecord, VisitRecord,
)


class ProgressUI:
    """A tqdm bar per visit and one line per finished visit."""

    def __init__(self, config: Config, quiet: bool):
        self.total = config.stop.steps_per_visit
        self.quiet = quiet
        self.bar = None
        self.key = None
        self.budget: int | None = None  # bytes, once a budget plan is recorded

    def note(self, text: str) -> None:
        if not self.quiet:
            tqdm.write(text)

    def record(self, record: Record) -> None:
        if self.quiet:
            return
        if isinstance(record, CacheRecord):
            self.close()
            if record.how in ("input", "roll_forward"):
                source = "the input" if record.how == "input" else f"the store at boundary {record.from_}"
                tqdm.write(f"store at boundary {record.boundary}: made from {source} in "
                           f"{record.seconds:.1f} s ({record.bytes / 2**20:.1f} MiB)")
            elif record.how == "probe":
                tqdm.write(f"pre-inference: timed the stores' disk with a {record.bytes / 2**20:.1f} MiB store at "
                           f"boundary 1 in {record.seconds:.1f} s (deleted)")
            return
        if isinstance(record, ResumeRecord):
            changed = "; ".join(f"{key} {before!r} -> {after!r}" for key, (before, after) in record.changed.items())
            tqdm.write(f"resumed after step {record.step}" + (f"; changed {changed}" if changed else ""))
            return
        if isinstance(record, BudgetPlanRecord):
            self.budget = record.budget
            tqdm.write(budget_line(record))
            return
        if isinstance(record, (SweepPlanRecord, PlanOutcomeRecord, ImportanceRecord)):
            self.close()
            tqdm.write(record.line())
            return
        if isinstance(record, PreInferenceRecord):
            self.close()
            tqdm.write(f"block {record.block}: {record.decision} (pre-inference would save "
                       f"{record.saving_s:.1f} s over {record.steps} steps)")
            return
        if isinstance(record, VisitRecord):
            self.close()
            peak = record.memory.get("tracked_peak", 0)
            against = f" ({visit_against_budget(peak, self.budget)})" if self.budget and peak else ""
            tqdm.write(
                f"sweep {record.sweep} block {record.block} ({record.label}): eval loss "
                f"{record.eval_loss:.4f} after {record.steps} steps ({record.stop_reason}), "
                f"{record.wall_s:.1f} s + eval {record.eval_s:.1f} s, peak tracked memory {peak / 2**20:.1f} MiB{against}"
            )
            return
        key = (record.sweep, record.block)
        if key != self.key:
            self.close()
            self.key = key
            self.bar = tqdm(total=self.total, desc=f"sweep {key[0]} block {key[1]}", unit="step", leave=False)
        self.bar.set_postfix(loss=f"{record.loss:.3f}", tok_s=f"{record.tokens_per_s:.0f}", refresh=False)
        self.bar.update(1)  # redraws at most every 0.1 s (tqdm's mininterval), the postfix with it

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar, self.key = None, None
