"""Runs several `preinfer` command lines, one after the other, in the processes of one torchrun job (so that
their start-up, torch and transformers imports included, is paid once): `torchrun ...
tests/helpers/pipeline_driver.py RUNS.json`, where RUNS.json holds `runs`, a list of argument lists, `pinned`:
whether pre-inference plans with `pinned_rates.PINNED` instead of what it measures, and optionally `halts`:
{run index: global step} for runs whose fit halts after that step (as `Trainer.fit(max_total_steps)` does: a
checkpoint, mid-visit where the step is), `refused`: {run index: exit code} for runs that must fail with that code
(each rank writes what the run printed to stderr to `refused-INDEX-rank-RANK.txt` beside RUNS.json, and goes on
to the next run), and `kill`: [rank, step], the last run having that rank's process SIGKILL itself as it starts the
forward of that step (a node lost mid-visit; the job fails there). Exits with the first exit code that is not the
run's own (0, or its `refused` code)."""

import contextlib
import json
import os
import signal
import sys
from pathlib import Path

from pinned_rates import pin_rates  # this script's own folder, tests/helpers/, is first on sys.path
from pipelines.cli import main
from preinfer.seams import SingleProcess
from preinfer.trainer import Trainer

FIT = Trainer.fit
FORWARD_BACKWARD = SingleProcess.forward_backward


def halting_at(steps: int | None):
    """`Trainer.fit` halting after global step `steps` (None: running to the end)."""
    return lambda trainer, max_total_steps=None: FIT(trainer, steps if steps is not None else max_total_steps)


def killed_at(step: int):
    """`SingleProcess.forward_backward` (data parallel's too) SIGKILLing this process as it starts the forward of
    its `step`-th step (1, 2, ...; one forward_backward a step)."""
    calls = []

    def forward_backward(seams, *args, **kwargs):
        calls.append(None)
        if len(calls) == step:
            os.kill(os.getpid(), signal.SIGKILL)
        return FORWARD_BACKWARD(seams, *args, **kwargs)

    return forward_backward


def refused_run(arguments: list[str], stderr: Path) -> int:
    """The exit code of the run `arguments`, what it printed to stderr written to `stderr`."""
    with stderr.open("w") as written, contextlib.redirect_stderr(written):
        return main(arguments)


if __name__ == "__main__":
    listing = json.loads(open(sys.argv[1]).read())
    if listing["pinned"]:
        pin_rates(setattr)
    halts = {int(index): steps for index, steps in listing.get("halts", {}).items()}
    refused = {int(index): code for index, code in listing.get("refused", {}).items()}
    rank = int(os.environ["RANK"])
    for index, arguments in enumerate(listing["runs"]):
        Trainer.fit = halting_at(halts.get(index))
        kill = listing.get("kill")
        if kill and index == len(listing["runs"]) - 1 and rank == kill[0]:
            SingleProcess.forward_backward = killed_at(kill[1])
        stderr = Path(sys.argv[1]).with_name(f"refused-{index}-rank-{rank}.txt")
        code = refused_run(arguments, stderr) if index in refused else main(arguments)
        if code != refused.get(index, 0):
            sys.exit(code or f"pipeline_driver: run {index} exited 0, not with its refusal's {refused[index]}")
