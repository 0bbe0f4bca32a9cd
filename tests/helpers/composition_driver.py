"""Runs the `preinfer` command lines of a listing in the processes of one torchrun job, as pipeline_driver.py does,
but runs every one whatever the others' exit codes, and rank 0 writes what each did: `torchrun ...
tests/helpers/composition_driver.py RUNS.json OUT.json`, where RUNS.json holds `runs`, a list of [name, argument
list], and OUT.json gets {name: {"code": exit code, "err": stderr, "loaded": whether a model was built}}."""

import json
import os
import sys

from composition import outcome, quick_finish  # this script's own folder, tests/helpers/, is first on sys.path

if __name__ == "__main__":
    quick_finish(setattr)
    listing = json.loads(open(sys.argv[1]).read())
    done = {name: outcome(arguments) for name, arguments in listing["runs"]}
    if os.environ.get("RANK", "0") == "0":
        with open(sys.argv[2], "w") as out:
            json.dump(done, out)
