"""A run's directory (`preinfer.run_dir.RunDir`) from start to finish: refused when it cannot take the run,
created with the run's config, and finished with the export, the loss plot and the summary."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path

from preinfer.config import Config, dump_toml
from preinfer.errors import UsageError
from preinfer.metrics import plot_losses, read_metrics
from preinfer.run_dir import RunDir
from preinfer.trainer import Trainer


def check_run_dir(run: RunDir, resume: bool) -> None:
    """Refuse an --out that is a file, that holds another run (unless resuming it), or nothing to resume."""
    out = run.path
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {out} is a file, not a directory")
    if resume:
        if not run.checkpoint.is_dir():
            raise UsageError(f"--resume: {out} holds no checkpoint to resume from")
        return
    if run.holds_run():
        raise UsageError(f"--out {out} already holds a run; pass --resume to continue it or choose another --out")


def prepare_run_dir(run: RunDir, config: Config, resume: bool) -> None:
    """Create the run directory with its config (a resumed run keeps its own); refusals as `check_run_dir`."""
    check_run_dir(run, resume)
    if not resume:
        run.path.mkdir(parents=True, exist_ok=True)
        run.config.write_text(dump_toml(config))


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
