"""A caching job killed with SIGKILL in the middle (a real subprocess) resumes to the store of an uninterrupted run."""

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from storage import open_store
from test_cache import BATCH, PER_SHARD, SEQ, assert_same_cache, cache, stored_datasets, run_cli, staged_model, write_corpus

REPO = Path(__file__).resolve().parents[1]
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


def test_a_job_killed_with_sigkill_resumes_to_an_identical_store(tmp_path, capsys):
    corpus = write_corpus(tmp_path / "corpus.txt")
    out = tmp_path / "c"
    args = ["cache", "--model", "tiny-llama", "--data", corpus, "--seq-len", str(SEQ), "--boundary", "2", "--out",
            str(out), "--samples-per-shard", str(PER_SHARD), "--batch-size", str(BATCH), "--quiet"]
    proc = start_slow_cache(args, REPO, OMP_NUM_THREADS="1")
    done_dir = out / "train" / "done"
    kill_once(proc, lambda: done_dir.is_dir() and len(list(done_dir.glob("shard-*.json"))) >= 3)
    assert proc.returncode == -signal.SIGKILL
    store = open_store(out / "train", check_files=False)
    finished = len(store.completed_shards())
    assert 3 <= finished <= HELD < store.num_shards and not store.manifest["complete"]
    assert not (out / "cache.json").exists()

    code, stdout, err = run_cli(args, capsys)  # the same command again
    assert code == 0, err
    assert f"{finished} already done" in stdout
    cache(staged_model(), stored_datasets(corpus), 2, tmp_path / "ref")
    assert_same_cache(out, tmp_path / "ref")
