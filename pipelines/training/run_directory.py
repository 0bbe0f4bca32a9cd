"""A run's directory (`preinfer.run_dir.RunDir`) from start to finish: held and checked (`pipelines.jobs.runs`),
created with the run's config and inputs, and finished with the export, the loss plot and the summary."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path

from preinfer.atomic_write import write_atomically
from preinfer.config import Config, dump_toml
from preinfer.errors import PreinferError
from preinfer.metrics import plot_losses, read_metrics
from preinfer.run_dir import RunDir
from preinfer.trainer import Trainer
from pipelines.data.corpus import CorpusDigest
from pipelines.jobs.inputs import input_fingerprints, recorded_config, write_inputs
from pipelines.jobs.runs import check_run_dir


def prepare_run_dir(run: RunDir, config: Config, resume: bool, corpus: CorpusDigest | None = None) -> None:
    """Create the run directory with its config, its paths absolute, and the fingerprints of its inputs (a resumed
    run keeps its own; a run started again after a failed start drops that start's metrics); refusals as
    `check_run_dir`. `corpus`: the corpus's fingerprint where the run has it already."""
    check_run_dir(run, resume)
    if resume:
        return
    inputs = input_fingerprints(config, corpus)
    try:
        run.path.mkdir(parents=True, exist_ok=True)
        run.metrics.unlink(missing_ok=True)
        run.write_config(dump_toml(recorded_config(config)))
        write_inputs(run, inputs)
    except OSError as err:
        run.config.unlink(missing_ok=True)  # a config without its inputs would resume unchecked
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
    write_atomically(run.summary, json.dumps(summary, indent=1))
    return summary
