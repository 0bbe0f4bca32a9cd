"""`preinfer cache --dask tcp://...` on a cluster started the way an admin starts one, with the `dask scheduler` and
`dask worker` commands: each worker has its local directory first on sys.path and its spill directory `storage`
in it, which shadowed our `storage` package until the client registered its import plugin."""

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.cache_jobs import BATCH, PER_SHARD, SEQ, assert_same_cache, cache, staged_model, stored_datasets
from tests.helpers.cli_run import run_cli
from tests.helpers.corpus_samples import write_corpus

pytestmark = pytest.mark.distributed

DASK = Path(sys.executable).parent / "dask"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def stop(procs: list[subprocess.Popen]) -> None:
    """SIGTERM each command's process group (the worker command's nannies and workers too), SIGKILL stragglers."""
    for proc in procs:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
    for proc in procs:
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.fixture
def cluster(tmp_path):
    """(scheduler address, scratch directory) of a scheduler and two single-threaded workers started by the CLI."""
    from distributed import Client

    scratch = tmp_path / "scratch"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DASK_TEMPORARY_DIRECTORY": str(scratch)}
    address = f"tcp://127.0.0.1:{free_port()}"
    commands = [[str(DASK), "scheduler", "--host", "127.0.0.1", "--port", address.rsplit(":", 1)[1],
                 "--no-dashboard"],
                [str(DASK), "worker", address, "--nworkers", "2", "--nthreads", "1", "--no-dashboard"]]
    procs: list[subprocess.Popen] = []
    try:
        for command in commands:
            procs.append(subprocess.Popen(command, cwd=tmp_path, env=env, stdout=subprocess.DEVNULL,
                                          stderr=subprocess.DEVNULL, start_new_session=True))
        with Client(address, timeout="60s") as client:
            client.wait_for_workers(2, timeout=120)
        yield address, scratch
    finally:
        stop(procs)


@pytest.mark.timeout(300)
def test_a_cluster_started_with_the_dask_cli_gives_the_local_store(cluster, tmp_path, capsys):
    address, scratch = cluster
    shadows = list(scratch.glob("dask-scratch-space/worker-*/storage"))
    assert len(shadows) == 2 and not any((d / "__init__.py").exists() for d in shadows)  # the namespace trap
    corpus = write_corpus(tmp_path / "corpus.txt")
    code, _, err = run_cli(["cache", "--model", "tiny-llama", "--data", corpus, "--seq-len", str(SEQ), "--boundary",
                            "2", "--out", str(tmp_path / "c"), "--samples-per-shard", str(PER_SHARD), "--batch-size",
                            str(BATCH), "--dask", address, "--quiet"], capsys)
    assert code == 0, err
    cache(staged_model(), stored_datasets(corpus), 2, tmp_path / "ref")
    assert_same_cache(tmp_path / "c", tmp_path / "ref")
