"""The caching job on Dask: one LocalCluster of 2 worker processes for the whole module (`--dask local:2` jobs of
one process share it), identical stores, the model loaded once per worker, retried and failing shards."""

import functools
import json

import pytest
import torch

from pipelines.cache import CacheOptions, roll_forward
from pipelines.cache import dask_runner
from pipelines.cache.dask_runner import local_client, shutdown_local_clusters, worker_device
from pipelines.cache.result import CacheJobError
from storage import open_store
from tests.helpers.cache_jobs import BATCH, PER_SHARD, SEQ, assert_same_cache, cache, staged_model, stored_datasets
from tests.helpers.cli_run import run_cli
from tests.helpers.shard_faults import cli_hook, fail_once, fail_shards


@pytest.fixture(scope="module")
def reference(cache_corpus, tmp_path_factory):
    """The single-process store (`--workers 1`) the Dask runs must equal."""
    out = tmp_path_factory.mktemp("ref") / "c"
    cache(staged_model(), stored_datasets(cache_corpus), 2, out)
    return out


@pytest.fixture(scope="module")
def workers():
    """The client of this process's `local:2` cluster."""
    client = local_client(2)
    yield client
    shutdown_local_clusters()


def cli_args(cache_corpus, out, *extra):
    return ["cache", "--model", "tiny-llama", "--data", cache_corpus, "--seq-len", str(SEQ), "--boundary", "2", "--out",
            str(out), "--samples-per-shard", str(PER_SHARD), "--batch-size", str(BATCH), "--quiet", *extra]


@pytest.mark.distributed
def test_dask_local_2_gives_the_store_of_one_worker_and_loads_the_model_once_per_worker(
        workers, cache_corpus, reference, tmp_path, capsys):
    code, stdout, err = run_cli(cli_args(cache_corpus, tmp_path / "c", "--dask", "local:2", "--json"), capsys)
    assert code == 0, err
    result = json.loads(stdout)
    assert result["workers"] == "local:2" and result["shards_computed"] > 4
    loads = result["model_loads"]
    assert len(loads) == 2 and set(loads.values()) == {1}  # both workers took shards, each loaded the model once
    assert_same_cache(tmp_path / "c", reference)
    # a second job in the same process reuses the cluster and the loaded models (a roll-forward, say)
    staged = staged_model()
    rolled = roll_forward(staged, tmp_path / "c", 3, tmp_path / "r3", CacheOptions(
        samples_per_shard=PER_SHARD, batch_size=BATCH, progress=False, model_name="tiny-llama", dask="local:2"))
    assert set(rolled.model_loads.values()) == {1}
    cache(staged, stored_datasets(cache_corpus), 3, tmp_path / "f3")
    assert_same_cache(tmp_path / "r3", tmp_path / "f3")


@pytest.mark.distributed
def test_a_dask_task_that_fails_once_is_retried(workers, cache_corpus, reference, tmp_path):
    hook = functools.partial(fail_once, str(tmp_path), frozenset({"train/2", "eval/1"}))
    result = cache(staged_model(), stored_datasets(cache_corpus), 2, tmp_path / "c", dask=workers, retries=1,
                   before_shard_write=hook)
    assert (tmp_path / "fault-train-2").exists() and (tmp_path / "fault-eval-1").exists()
    assert result.shards_computed == sum(s.num_shards for s in result.splits.values())
    assert_same_cache(tmp_path / "c", reference)


@pytest.mark.distributed
def test_a_dask_shard_that_always_fails_is_named_and_the_rest_stay_intact(workers, cache_corpus, reference, tmp_path,
                                                                        capsys, monkeypatch):
    cli_hook(monkeypatch, functools.partial(fail_shards, frozenset({"train/3"})))
    address = workers.scheduler.address
    code, _, err = run_cli(cli_args(cache_corpus, tmp_path / "c", "--dask", address, "--retries", "1"), capsys)
    assert code == 1 and len(err.strip().splitlines()) == 1, err
    assert "train shard 3 (samples 48..64)" in err and "injected fault" in err
    store, ref = open_store(tmp_path / "c" / "train"), open_store(reference / "train")
    assert store.missing_shards() == [3] and not store.manifest["complete"]
    for i in store.completed_shards():
        assert all(torch.equal(a, b) for a, b in zip(store.read_shard(i).values(), ref.read_shard(i).values()))
    assert not (tmp_path / "c" / "cache.json").exists()


@pytest.mark.distributed
def test_workers_refuse_a_model_other_than_the_clients(workers, cache_corpus, tmp_path):
    staged = staged_model(seed=1)  # the workers load tiny-llama with seed 0
    with pytest.raises(CacheJobError, match="another prefix"):
        cache(staged, {"eval": stored_datasets(cache_corpus)["eval"]}, 2, tmp_path / "c", dask=workers, retries=0)


@pytest.mark.distributed
def test_an_overwrite_on_dask_rewrites_every_shard(workers, cache_corpus, reference, tmp_path):
    """Workers must not trust what they knew about a store that was deleted and recreated at the same path."""
    data = {"eval": stored_datasets(cache_corpus)["eval"]}
    for _ in range(2):
        result = cache(staged_model(), data, 2, tmp_path / "c", dask=workers, mode="overwrite")
        assert result.shards_computed == result.splits["eval"].num_shards
    assert_same_cache(tmp_path / "c", reference, splits=("eval",))


@pytest.mark.distributed
def test_a_cluster_that_lost_every_worker_fails_the_job_instead_of_waiting_forever(cache_corpus, tmp_path, monkeypatch):
    from distributed import Client, LocalCluster

    monkeypatch.setattr(dask_runner, "POLL_S", 0.2)
    monkeypatch.setattr(dask_runner, "NO_WORKERS_TIMEOUT_S", 1.0)
    with LocalCluster(n_workers=0, processes=False, dashboard_address=":0") as cluster, Client(cluster) as client:
        with pytest.raises(CacheJobError, match=r"no workers for \d+ s.*0 of \d+ shards are finished"):
            cache(staged_model(), {"eval": stored_datasets(cache_corpus)["eval"]}, 2, tmp_path / "c", dask=client)


@pytest.mark.parametrize("device, name, gpus, expected", [
    ("cuda", 0, 2, "cuda:0"), ("cuda", 1, 2, "cuda:1"), ("cuda", 2, 2, "cuda:0"), ("cuda", 3, 3, "cuda:0"),
    ("cuda", 5, 1, "cuda:0"),
    ("cuda:1", 0, 2, "cuda:1"),  # an explicit GPU is every worker's
    ("cpu", 1, 2, "cpu"),
    ("cuda", "tcp://10.0.0.5:4000", 2, "cuda"),  # a remote worker keeps its own CUDA_VISIBLE_DEVICES placement
    ("cuda", None, 2, "cuda"),  # not on a worker
])
def test_local_workers_take_the_visible_gpus_round_robin(device, name, gpus, expected):
    assert worker_device(device, name, gpus) == expected


@pytest.mark.distributed
def test_local_cluster_workers_are_named_by_their_index_so_each_gets_its_own_gpu(workers):
    names = workers.run(lambda dask_worker: dask_worker.name)
    assert sorted(names.values()) == [0, 1]
    assert sorted(worker_device("cuda", name, 2) for name in names.values()) == ["cuda:0", "cuda:1"]
