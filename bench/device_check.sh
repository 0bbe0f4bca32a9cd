#!/usr/bin/env bash
# The prepared GPU check of issues 37 (part 5) and 45 (part 5), on one CUDA GPU:
#   1. the invariant tests marked `cuda` (pytest -m cuda);
#   2. the planner against torch.cuda.max_memory_allocated on each memory row, and steps/s of `preinfer bcd`
#      against a plain loop (python -m bench.device_memory, JSON in bench/out/device_memory.json);
#   3. a streamed visit next to a resident one (--stream-frozen: pinned host copies, side-stream copies): each
#      visit's device peak against the plan's, and the step time streamed / resident (python -m
#      bench.stream_frozen --device cuda, JSON in bench/out/stream_frozen.json); then the streamed runs' own path
#      on CUDA (tests/test_device_placement.py, marked cuda: what loading places on the device, and
#      --stream-frozen --masters disk against --masters host, nf4 and frozen dtype auto, exports bit for bit).
# At most 8 minutes for 1-2 and 4 for 3; `bash bench/device_check.sh stream` runs 3 alone (a rerun that fits one
# 10-minute command). On a machine without a CUDA GPU it says so in one line and exits 0.
#
#   bash bench/device_check.sh [stream]   # PYTHON=/path/to/python to choose the interpreter
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if ! "$PYTHON" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' >/dev/null 2>&1; then
    echo "device check: no CUDA GPU here (torch.cuda.is_available() is False); nothing to run"
    exit 0
fi
if [ "${1:-}" != stream ]; then
    timeout 150 "$PYTHON" -m pytest -q -p no:cacheprovider -m cuda tests --ignore tests/test_device_placement.py
    timeout 320 "$PYTHON" -m bench.device_memory
fi
timeout 120 "$PYTHON" -m bench.stream_frozen --device cuda --model medium-llama --precision bf16-mixed \
    --frozen-dtype int8 --recompute --fused-step --seq-len 512 --batch-size 4 --grad-accum 2 --steps 6 --repeats 1
timeout 120 "$PYTHON" -m pytest -q -p no:cacheprovider -m cuda tests/test_device_placement.py
