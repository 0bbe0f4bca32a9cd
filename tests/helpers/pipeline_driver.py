"""Runs several `preinfer` command lines, one after the other, in the processes of one torchrun job (so that
their start-up, torch and transformers imports included, is paid once): `torchrun ...
tests/helpers/pipeline_driver.py RUNS.json`, where RUNS.json holds `runs`, a list of argument lists, and `pinned`:
whether pre-inference plans with `pinned_rates.PINNED` instead of what it measures. Exits with the first non-zero
exit code."""

import json
import sys

from pinned_rates import pin_rates  # this script's own folder, tests/helpers/, is first on sys.path
from pipelines.cli import main

if __name__ == "__main__":
    listing = json.loads(open(sys.argv[1]).read())
    if listing["pinned"]:
        pin_rates(setattr)
    for arguments in listing["runs"]:
        code = main(arguments)
        if code:
            sys.exit(code)
