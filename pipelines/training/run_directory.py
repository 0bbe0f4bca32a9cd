"""A run's directory (`preinfer.run_dir.RunDir`) from start to finish, as `bcd` and `train` hold it: the run's
config (on --resume, the path flags compared as the run recorded its own), the directory held for the whole job and
checked before anything is loaded (on --resume the inputs are then checked against what the run was trained on:
`pipelines.training.inputs`), created with the run's config and inputs, and finished with the export, the loss plot
and the summary."""

from __future__ import annotations

import argparse
import contextlib
import json
import math
from collections.abc import Callable, Iterator
from pathlib import Path

from preinfer.atomic_write import write_atomically, write_directory_atomically
from preinfer.config import Config, dump_toml
from preinfer.errors import PreinferError, UsageError, remedy
from preinfer.metrics import plot_losses, read_metrics
from preinfer.run_dir import RunDir
from preinfer.trainer import Trainer
from pipelines.data.corpus import CorpusDigest
from pipelines.flags import config_for_command, run_dir
from pipelines.jobs.output import check_not_a_file, held_output
from pipelines.training.inputs import absolute_flags, input_fingerprints, recorded_config, write_inputs


def run_config(args: argparse.Namespace) -> Config:
    """The config of a `bcd` or `train` run (`pipelines.flags.config_for_command`); resuming a run that recorded
    its inputs, the path flags given are made absolute first, as the run's own paths are."""
    if args.resume and run_dir(args).inputs.is_file():
        absolute_flags(args)
    return config_for_command(args)


def check_run_dir(run: RunDir, resume: bool) -> None:
    """Refuse an --out that is a file, a directory holding what a run does not write, another run (unless resuming
    it; a run that stopped before its first checkpoint may be started again), or nothing to resume."""
    out = run.path
    check_not_a_file(out)
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
    """Hold the run directory for the whole job (rank 0, for every rank), then check it (`check_run_dir`); a
    resumed run's inputs are checked next (`pipelines.training.inputs.check_inputs`), once the corpus is
    fingerprinted."""
    held = held_output(run.path, "--out") if rank == 0 else contextlib.nullcontext()
    with held:
        if rank == 0:
            check_run_dir(run, resume)
        yield


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
                            f"{remedy(err)}, then run the same command again") from None


def finish_run(trainer: Trainer, run: RunDir, export: Callable[[Path], object]) -> dict:
    """Export (`export` fills a directory published whole as the run's export: the previous one is kept until the
    new one is complete), plot and summarise a finished run (rank 0 writes; other ranks return the summary only)."""
    visits = trainer.position.visits
    final = visits[-1]["eval_loss"] if visits else math.nan
    summary = {
        "final_eval_loss": final,
        "final_eval_ppl": math.exp(final) if final < 50 else math.inf,
        "tokens": trainer.position.tokens,
        "steps": trainer.position.global_step,
        "wall_s": trainer.wall_s,
        "eval_s": sum(visit.get("eval_s", 0.0) for visit in visits),
        "peak_memory": {k: max(v["memory"].get(k, 0) for v in visits) for k in visits[0]["memory"]} if visits else {},
        "visits": visits,
    }
    if trainer.rank != 0:
        return summary
    write_directory_atomically(run.export, export)
    records = read_metrics(run.metrics)
    plot_losses({"BCD": records}, run.loss_plot, title=f"{trainer.config.model.name}: {run.path.name}")
    write_atomically(run.summary, json.dumps(summary, indent=1))
    return summary
