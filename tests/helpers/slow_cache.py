"""A caching job in a subprocess, slowed down so that it can be killed with SIGKILL in the middle."""

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# `preinfer cache` with a pause before every shard write (so that it can be killed in the middle), and from shard
# `HELD` on a wait of its own that only the kill ends (so that it cannot finish first, however slowly the test
# that kills it is scheduled); the jobs of these tests have more shards than that in their train split.
HELD = 6
SLOW_CACHE = f"""
import functools, sys, time
from pipelines.cli import main
from pipelines.commands import cache

pause = lambda split, shard: time.sleep(0.2 if shard < {HELD} else 3600)
cache.CacheOptions = functools.partial(cache.CacheOptions, before_shard_write=pause)
sys.exit(main(sys.argv[1:]))
"""


def start_slow_cache(args: list[str], cwd: Path, **env: str) -> subprocess.Popen:
    """`preinfer cache ARGS` as SLOW_CACHE in a subprocess that imports this checkout."""
    env = {**os.environ, **env, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    return subprocess.Popen([sys.executable, "-c", SLOW_CACHE, *args], cwd=cwd, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def kill_once(proc: subprocess.Popen, enough_done: Callable[[], bool]) -> None:
    """SIGKILL the job as soon as `enough_done()` (within 4 minutes: a loaded machine), asserting it was still
    running."""
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and proc.poll() is None and not enough_done():
        time.sleep(0.05)
    assert proc.poll() is None, f"the job ended before it could be killed: {proc.stderr.read().decode()[-2000:]}"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    proc.stderr.close()
