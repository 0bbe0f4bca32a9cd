"""Jobs that join the model side (`preinfer`) and the stores (`storage`): caching, training, planning, the CLI."""

import os

# OpenMP threads that sleep instead of spinning while they wait: on small machines whose cores are shared with
# the store reader's threads or other jobs, spinning workers slowed a small-llama forward 3-13x (bench/train.py).
# Set before torch loads; an explicit OMP_WAIT_POLICY wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
