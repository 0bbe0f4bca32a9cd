#!/usr/bin/env bash
# The prepared GPU check of issue 37 (part 5), at most 8 minutes on one CUDA GPU:
#   1. the invariant tests marked `cuda` (pytest -m cuda);
#   2. the planner against torch.cuda.max_memory_allocated on each memory row, and steps/s of `preinfer bcd`
#      against a plain loop (python -m bench.device_memory, JSON in bench/out/device_memory.json).
# On a machine without a CUDA GPU it says so in one line and exits 0.
#
#   bash bench/device_check.sh            # PYTHON=/path/to/python to choose the interpreter
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if ! "$PYTHON" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' >/dev/null 2>&1; then
    echo "device check: no CUDA GPU here (torch.cuda.is_available() is False); nothing to run"
    exit 0
fi
timeout 150 "$PYTHON" -m pytest -q -p no:cacheprovider -m cuda tests
timeout 320 "$PYTHON" -m bench.device_memory
