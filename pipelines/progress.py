"""The progress display of every job: `Progress` shows one tqdm bar at a time on stderr (a visit's steps, the
shards a caching job writes, the tokens a tokenize job encodes) and whole lines between them on stdout (a
finished visit, a store made, a plan), which never break the bar; a quiet job shows nothing."""

from __future__ import annotations

import threading
import time
from collections.abc import Hashable
from typing import Any

from tqdm import tqdm

from preinfer.memory.budget import budget_line, visit_against_budget
from preinfer.metrics import (
    BudgetPlanRecord, CacheRecord, ImportanceRecord, PlanOutcomeRecord, PreInferenceRecord, Record, ResolvedRecord,
    ResumeRecord, SweepPlanRecord, VisitRecord,
)


class Progress:
    """A job's bar and lines (see the module docstring); `advance` may be called from several threads.
    `steps_per_visit`: the length of a visit's bar, for a run's records (`record`)."""

    def __init__(self, quiet: bool = False, steps_per_visit: int | None = None) -> None:
        self.quiet = quiet
        self.steps_per_visit = steps_per_visit
        self.bar: Any = None
        self.key: Hashable = None  # what the open bar counts (a visit's (sweep, block))
        self.budget: int | None = None  # bytes, once a run's budget plan is recorded
        self.started = time.perf_counter()
        self.tokens = 0
        self.bytes = 0
        self._lock = threading.Lock()

    def note(self, text: str) -> None:
        """Print one whole line (between the bar's redraws)."""
        if not self.quiet:
            tqdm.write(text)

    def start(self, desc: str, unit: str, total: int | None = None, key: Hashable = None, **options: Any) -> None:
        """Open a bar counting `unit`s (closing the open one); `options` go to tqdm (unit_scale, dynamic_ncols)."""
        self.close()
        self.key, self.started, self.tokens, self.bytes = key, time.perf_counter(), 0, 0
        self.bar = tqdm(total=total, desc=desc, unit=unit, leave=False, disable=self.quiet, **options)

    def advance(self, n: int = 1, tokens: int = 0, nbytes: int = 0) -> None:
        """Count `n` more units; `tokens` and `nbytes` (written) add to the rates the bar shows."""
        with self._lock:
            self.tokens += tokens
            self.bytes += nbytes
            if self.bar is None:
                return
            if tokens or nbytes:
                elapsed = max(time.perf_counter() - self.started, 1e-9)
                self.bar.set_postfix_str(f"{self.tokens / elapsed:,.0f} tok/s, {self.bytes / 2**20:,.1f} MB",
                                         refresh=False)
            self.bar.update(n)  # redraws at most every 0.1 s (tqdm's mininterval), the postfix with it

    def close(self) -> None:
        """Close the open bar, if any (a line printed after it starts a line of its own)."""
        if self.bar is not None:
            self.bar.close()
            self.bar, self.key = None, None

    def record(self, record: Record) -> None:
        """Show a run's record: a step advances its visit's bar; the others are one line each."""
        if self.quiet:
            return
        if isinstance(record, BudgetPlanRecord):
            self.budget = record.budget
            tqdm.write(budget_line(record))
            return
        if isinstance(record, ResumeRecord):
            changed = "; ".join(f"{key} {before!r} -> {after!r}" for key, (before, after) in record.changed.items())
            tqdm.write(f"resumed after step {record.step}" + (f"; changed {changed}" if changed else ""))
            return
        text = self._record_line(record)
        if text is not None:
            self.close()
            if text:
                tqdm.write(text)
            return
        key = (record.sweep, record.block)
        if key != self.key:
            self.start(f"sweep {key[0]} block {key[1]}", "step", self.steps_per_visit, key=key)
        self.bar.set_postfix(loss=f"{record.loss:.3f}", tok_s=f"{record.tokens_per_s:.0f}", refresh=False)
        self.bar.update(1)

    def _record_line(self, record: Record) -> str | None:
        """The line of a record that ends the open bar ('' for one that shows none); None for a step."""
        if isinstance(record, ResolvedRecord):
            return ""  # the run's first lines say it (its precision, partition and expansion)
        if isinstance(record, CacheRecord):
            if record.how in ("input", "roll_forward"):
                source = "the input" if record.how == "input" else f"the store at boundary {record.from_}"
                return (f"store at boundary {record.boundary}: made from {source} in {record.seconds:.1f} s "
                        f"({record.bytes / 2**20:.1f} MiB)")
            if record.how == "probe":
                return (f"pre-inference: timed the stores' disk with a {record.bytes / 2**20:.1f} MiB store at "
                        f"boundary 1 in {record.seconds:.1f} s (deleted)")
            return ""
        if isinstance(record, (SweepPlanRecord, PlanOutcomeRecord, ImportanceRecord)):
            return record.line()
        if isinstance(record, PreInferenceRecord):
            return (f"block {record.block}: {record.decision} (pre-inference would save {record.saving_s:.1f} s "
                    f"over {record.steps} steps)")
        if isinstance(record, VisitRecord):
            peak = record.memory.get("tracked_peak", 0)
            against = f" ({visit_against_budget(peak, self.budget)})" if self.budget and peak else ""
            return (f"sweep {record.sweep} block {record.block} ({record.label}): eval loss {record.eval_loss:.4f} "
                    f"after {record.steps} steps ({record.stop_reason}), {record.wall_s:.1f} s + eval "
                    f"{record.eval_s:.1f} s, peak tracked memory {peak / 2**20:.1f} MiB{against}")
        return None
