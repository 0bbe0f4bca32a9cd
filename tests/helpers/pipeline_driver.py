"""Runs several `preinfer` command lines, one after the other, in the processes of one torchrun job (so that
their start-up, torch and transformers imports included, is paid once): `torchrun ...
tests/helpers/pipeline_driver.py RUNS.json`, where RUNS.json holds `runs`, a list of argument lists, `pinned`:
whether pre-inference plans with `pinned_rates.PINNED` instead of what it measures, and optionally `halts`:
{run index: global step} for runs whose fit halts after that step (as `Trainer.fit(max_total_steps)` does: a
checkpoint, mid-visit where the step is), and `kill`: [rank, step], the last run having that rank's process SIGKILL
itself as it starts the forward of that step (a node lost mid-visit; the job fails there). Exits with the first
non-zero exit code."""

import json
import os
import signal
import sys

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


if __name__ == "__main__":
    listing = json.loads(open(sys.argv[1]).read())
    if listing["pinned"]:
        pin_rates(setattr)
    halts = {int(index): steps for index, steps in listing.get("halts", {}).items()}
    for index, arguments in enumerate(listing["runs"]):
        Trainer.fit = halting_at(halts.get(index))
        kill = listing.get("kill")
        if kill and index == len(listing["runs"]) - 1 and int(os.environ["RANK"]) == kill[0]:
            SingleProcess.forward_backward = killed_at(kill[1])
        code = main(arguments)
        if code:
            sys.exit(code)
