"""Runs several `preinfer` command lines, one after the other, in the processes of one torchrun job (so that
their start-up, torch and transformers imports included, is paid once): `torchrun ...
tests/helpers/pipeline_driver.py RUNS.json`, where RUNS.json holds `runs`, a list of argument lists, `pinned`:
whether pre-inference plans with `pinned_rates.PINNED` instead of what it measures, and optionally `halts`:
{run index: global step} for runs whose fit halts after that step (as `Trainer.fit(max_total_steps)` does: a
checkpoint, mid-visit where the step is). Exits with the first non-zero exit code."""

import json
import sys

from pinned_rates import pin_rates  # this script's own folder, tests/helpers/, is first on sys.path
from pipelines.cli import main
from preinfer.trainer import Trainer

FIT = Trainer.fit


def halting_at(steps: int | None):
    """`Trainer.fit` halting after global step `steps` (None: running to the end)."""
    return lambda trainer, max_total_steps=None: FIT(trainer, steps if steps is not None else max_total_steps)


if __name__ == "__main__":
    listing = json.loads(open(sys.argv[1]).read())
    if listing["pinned"]:
        pin_rates(setattr)
    halts = {int(index): steps for index, steps in listing.get("halts", {}).items()}
    for index, arguments in enumerate(listing["runs"]):
        Trainer.fit = halting_at(halts.get(index))
        code = main(arguments)
        if code:
            sys.exit(code)
