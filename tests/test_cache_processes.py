"""A caching job killed with SIGKILL in the middle (a real subprocess) resumes to the store of an uninterrupted run."""

import signal

import pytest

from storage import open_store
from tests.helpers.cache_jobs import BATCH, PER_SHARD, SEQ, assert_same_cache, cache, staged_model, stored_datasets
from tests.helpers.cli_run import run_cli
from tests.helpers.corpus_samples import write_corpus
from tests.helpers.slow_cache import HELD, REPO, kill_once, start_slow_cache

pytestmark = pytest.mark.distributed


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
