"""A run's directory (`preinfer.run_dir.RunDir`) from start to finish: refused when it cannot take the run,
created with the run's config, and finished with the export, the loss plot and the summary."""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Callable, Iterator
from pathlib import Path

import storage

from preinfer.config import Config, dump_toml
from preinfer.errors import PreinferError, UsageError
from preinfer.metrics import plot_losses, read_metrics
from preinfer.run_dir import RunDir
from preinfer.trainer import Trainer


def check_run_dir(run: RunDir, resume: bool) -> None:
    """Refuse an --out that is a file, a directory holding what a run does not write, another run (unless resuming
    it; a run that stopped before its first checkpoint may be started again), or nothing to resume."""
    out = run.path
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {out} is a file, not a directory")
    misplaced = run.misplaced_entries()
    if misplaced:
        raise UsageError(f"--out {out}: {misplaced[0]}; move it away and run again, nothing was changed")
    if resume:
        if not run.has_checkpoint():
            raise UsageError(f"--resume: {out} holds no checkpoint to resume from")
        return
    foreign = run.foreign_entries()
    if foreign:
        raise UsageError(f"--out {out} is not a run directory (it holds {foreign[0]!r}"
                         f"{' ...' if len(foreign) > 1 else ''}); choose an empty or new directory, nothing was deleted")
    if run.holds_run() and not run.failed_start():
        raise UsageError(f"--out {out} already holds a run; pass --resume to continue it or choose another --out")


@contextlib.contextmanager
def owning_run(run: RunDir, resume: bool, rank: int = 0) -> Iterator[None]:
    """Hold the run directory for the whole job (rank 0, for every rank), then check it (`check_run_dir`)."""
    held = storage.owning(run.path, "--out") if rank == 0 else contextlib.nullcontext()
    with held:
        if rank == 0:
            check_run_dir(run, resume)
        yield


def prepare_run_dir(run: RunDir, config: Config, resume: bool) -> None:
    """Create the run directory with its config (a resumed run keeps its own; a run started again after a failed
    start drops that start's metrics); refusals as `check_run_dir`."""
    check_run_dir(run, resume)
    if resume:
        return
    try:
        run.path.mkdir(parents=True, exist_ok=True)
        run.metrics.unlink(missing_ok=True)
        run.write_config(dump_toml(config))
    except OSError as err:
        raise PreinferError(f"writing {run.config} failed ({err.strerror or err}); nothing of the run is written, "
                            f"free space or fix the directory, then run the same command again") from None


def finish_run(trainer: Trainer, run: RunDir, export: Callable[[Path], object]) -> dict:
    """Export, plot and summarise a finished run (rank 0 writes; other ranks return the summary only)."""
    visits = trainer.progress.visits
    final = visits[-1]["eval_loss"] if visits else math.nan
    summary = {
        "final_eval_loss": final,
        "final_eval_ppl": math.exp(final) if final < 50 else math.inf,
        "tokens": trainer.progress.tokens,
        "steps": trainer.progress.global_step,
        "wall_s": trainer.wall_s,
        "eval_s": sum(visit.get("eval_s", 0.0) for visit in visits),
        "peak_memory": {k: max(v["memory"].get(k, 0) for v in visits) for k in visits[0]["memory"]} if visits else {},
        "visits": visits,
    }
    if trainer.rank != 0:
        return summary
    export(run.export)
    records = read_metrics(run.metrics)
    plot_losses({"BCD": records}, run.loss_plot, title=f"{trainer.config.model.name}: {run.path.name}")
    run.summary.write_text(json.dumps(summary, indent=1))
    return summary
