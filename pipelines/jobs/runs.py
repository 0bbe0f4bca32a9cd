"""A run directory as `bcd` and `train` hold it: the run's config (on --resume, the path flags compared as the run
recorded its own), the directory held for the whole job and checked before anything is loaded (on --resume the
inputs are then checked against what the run was trained on: `pipelines.jobs.inputs`)."""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Iterator

from preinfer.config import Config
from preinfer.errors import UsageError
from preinfer.run_dir import RunDir
from pipelines.flags import config_for_command
from pipelines.jobs.inputs import absolute_flags
from pipelines.jobs.output import held_output


def run_config(args: argparse.Namespace) -> Config:
    """The config of a `bcd` or `train` run (`pipelines.flags.config_for_command`); resuming a run that recorded
    its inputs, the path flags given are made absolute first, as the run's own paths are."""
    if args.resume and RunDir(args.run__out or Config().run.out).inputs.is_file():
        absolute_flags(args)
    return config_for_command(args)


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
    """Hold the run directory for the whole job (rank 0, for every rank), then check it (`check_run_dir`); a
    resumed run's inputs are checked next (`pipelines.jobs.inputs.check_inputs`), once the corpus is fingerprinted."""
    held = held_output(run.path, "--out") if rank == 0 else contextlib.nullcontext()
    with held:
        if rank == 0:
            check_run_dir(run, resume)
        yield
