"""A caching job killed with SIGKILL in the middle (a real subprocess) resumes to the store of an uninterrupted run."""

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch.multiprocessing as mp

from pipelines.cache import CacheJobError, Part
from storage import open_store
from test_cache import BATCH, PER_SHARD, SEQ, assert_same_cache, cache, stored_datasets, run_cli, staged_model, write_corpus

REPO = Path(__file__).resolve().parents[1]
# `preinfer cache` with a pause before every shard write (so that it can be killed in the middle).
SLOW_CACHE = """
import functools, sys, time
from pipelines.cli import main
from pipelines.commands import cache

cache.CacheOptions = functools.partial(cache.CacheOptions, before_shard_write=lambda split, shard: time.sleep(0.2))
sys.exit(main(sys.argv[1:]))
"""


def start_slow_cache(args: list[str], cwd: Path, **env: str) -> subprocess.Popen:
    """`preinfer cache ARGS` as SLOW_CACHE in a subprocess that imports this checkout."""
    env = {**os.environ, **env, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    return subprocess.Popen([sys.executable, "-c", SLOW_CACHE, *args], cwd=cwd, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def kill_once(proc: subprocess.Popen, enough_done: Callable[[], bool]) -> None:
    """SIGKILL the job as soon as `enough_done()` (within 2 minutes), asserting it was still running."""
    deadline = time.monotonic() + 120
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
    assert 3 <= finished < store.num_shards and not store.manifest["complete"]
    assert not (out / "cache.json").exists()

    code, stdout, err = run_cli(args, capsys)  # the same command again
    assert code == 0, err
    assert f"{finished} already done" in stdout
    cache(staged_model(), stored_datasets(corpus), 2, tmp_path / "ref")
    assert_same_cache(out, tmp_path / "ref")


def _cache_parts(rank: int, init_file: str, corpus: str, root: str) -> None:
    """One gloo rank of two caching jobs shared by two processes: one store both write (over a cache at another
    boundary), then one store each where the other does not look."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    written: list[tuple[str, int]] = []
    part = Part(rank, 2, dist.barrier)
    result = cache(staged_model(), stored_datasets(corpus), 2, Path(root, "shared"), mode="overwrite", part=part,
                   before_shard_write=lambda split, i: written.append((split, i)))
    Path(root, f"{rank}.json").write_text(json.dumps(dict(
        written=written, samples_computed=result.samples_computed, stored_bytes=result.stored_bytes)))
    try:
        cache(staged_model(), stored_datasets(corpus), 2, Path(root, f"rank-{rank}"), mode="overwrite", part=part)
    except CacheJobError as err:
        Path(root, f"{rank}.err").write_text(str(err))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def shared_jobs(tmp_path_factory) -> tuple[Path, str]:
    """The jobs of `_cache_parts` run by two processes; returns (their directory, the corpus)."""
    root = tmp_path_factory.mktemp("shared")
    corpus = write_corpus(root / "corpus.txt", paragraphs=20)
    cache(staged_model(), stored_datasets(corpus), 1, root / "shared")  # the first part overwrites it first
    mp.spawn(_cache_parts, args=(str(root / "init"), corpus, str(root)), nprocs=2, join=True)
    return root, corpus


def test_two_processes_sharing_a_job_each_write_their_shards_of_the_store_one_process_makes(shared_jobs, tmp_path):
    root, corpus = shared_jobs
    datasets = stored_datasets(corpus)
    ranks = [json.loads((root / f"{rank}.json").read_text()) for rank in (0, 1)]
    reference = cache(staged_model(), datasets, 2, tmp_path / "one")
    assert_same_cache(root / "shared", tmp_path / "one")
    assert json.loads((root / "shared" / "cache.json").read_text()) == json.loads(
        (tmp_path / "one" / "cache.json").read_text())
    for rank, part in enumerate(ranks):
        assert part["written"] and all(shard % 2 == rank for _, shard in part["written"])
        assert part["stored_bytes"] == reference.stored_bytes
    assert sorted(map(tuple, ranks[0]["written"] + ranks[1]["written"])) == sorted(
        (split, i) for split, s in reference.splits.items() for i in range(s.num_shards))
    assert ranks[0]["samples_computed"] + ranks[1]["samples_computed"] == reference.samples == sum(
        len(d) for d in datasets.values())


def test_parts_that_do_not_see_each_other_s_shards_stop_with_a_hint_and_finalize_nothing(shared_jobs):
    root, _ = shared_jobs
    for rank in (0, 1):
        message = (root / f"{rank}.err").read_text()
        assert f"part {rank} of 2 of a shared caching job does not see" in message and "s3://" in message
        assert not open_store(root / f"rank-{rank}" / "train", check_files=False).manifest["complete"]
