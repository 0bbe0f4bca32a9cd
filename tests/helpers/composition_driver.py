"""Runs the `preinfer` command lines of a listing in the processes of one torchrun job, as pipeline_driver.py does,
but runs every one whatever the others' exit codes, and rank 0 writes what each did: `torchrun ...
tests/helpers/composition_driver.py RUNS.json OUT.json`, where RUNS.json holds `runs`, a list of [name, argument
list], and OUT.json gets {name: {"code": exit code, "err": stderr, "loaded": whether a model was built}}."""

import contextlib
import io
import json
import os
import sys

from composition import ModelBuilds  # this script's own folder, tests/helpers/, is first on sys.path
from pipelines.cli import main


def run(arguments: list[str]) -> dict:
    err = io.StringIO()
    with ModelBuilds() as builds, contextlib.redirect_stderr(err):
        try:
            code = main(arguments)
        except SystemExit as exit_:
            code = exit_.code
    return {"code": code, "err": err.getvalue(), "loaded": builds.count > 0}


if __name__ == "__main__":
    listing = json.loads(open(sys.argv[1]).read())
    done = {name: run(arguments) for name, arguments in listing["runs"]}
    if os.environ.get("RANK", "0") == "0":
        with open(sys.argv[2], "w") as out:
            json.dump(done, out)
