"""Runs several `preinfer` command lines, one after the other, in the processes of one torchrun job (so that
their start-up, torch and transformers imports included, is paid once):
`torchrun ... tests/helpers/pipeline_driver.py RUNS.json`, where RUNS.json is a list of argument lists. Exits with
the first non-zero exit code."""

import json
import sys

from pipelines.cli import main

if __name__ == "__main__":
    for arguments in json.loads(open(sys.argv[1]).read()):
        code = main(arguments)
        if code:
            sys.exit(code)
