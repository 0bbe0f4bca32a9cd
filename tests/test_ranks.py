"""Pre-inference's work shared by the ranks of a data-parallel job, on two gloo processes started once: a caching
job both write (each its shards of one store), one whose parts write where the other does not look, and the
throughputs the ranks agree to plan with."""

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from pipelines.cache import CacheJobError, Part
from pipelines.pre_inference.ranks import slowest
from pipelines.pre_inference.sweep_plan import Throughputs
from storage import open_store
from tests.helpers.cache_jobs import assert_same_cache, cache, staged_model, stored_datasets
from tests.helpers.corpus_samples import write_corpus

pytestmark = pytest.mark.distributed

# What each rank measured: the agreed throughputs take the largest time and the smallest speed of each.
MEASURED = [Throughputs(1e-3, 2e8, 3e8, 0.05, {1: 0.2, 2: 0.4}, build_layer_seconds=4e-3),
            Throughputs(2e-3, 1e8, math.inf, 0.01, {1: 0.3, 2: 0.1}, build_layer_seconds=3e-3)]


def _rank(rank: int, init_file: str, corpus: str, root: str) -> None:
    """One gloo rank: the shared job (over a cache at another boundary), the job whose parts do not see each other,
    and the agreed throughputs; each outcome written under `root`."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    written: list[tuple[str, int]] = []
    part = Part(rank, 2, dist.barrier)
    result = cache(staged_model(), stored_datasets(corpus), 2, Path(root, "shared"), mode="overwrite", part=part,
                   before_shard_write=lambda split, i: written.append((split, i)))
    try:
        cache(staged_model(), stored_datasets(corpus), 2, Path(root, f"rank-{rank}"), mode="overwrite", part=part)
    except CacheJobError as err:
        Path(root, f"{rank}.err").write_text(str(err))
    agreed = slowest(MEASURED[rank], torch.device("cpu"))
    Path(root, f"{rank}.json").write_text(json.dumps(dict(
        written=written, samples_computed=result.samples_computed, stored_bytes=result.stored_bytes,
        agreed=dataclasses.asdict(agreed))))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> tuple[Path, str, list[dict]]:
    """`_rank` on two processes; returns (their directory, the corpus, each rank's outcomes)."""
    root = tmp_path_factory.mktemp("ranks")
    corpus = write_corpus(root / "corpus.txt", paragraphs=20)
    cache(staged_model(), stored_datasets(corpus), 1, root / "shared")  # the first part overwrites it first
    mp.spawn(_rank, args=(str(root / "init"), corpus, str(root)), nprocs=2, join=True)
    return root, corpus, [json.loads((root / f"{rank}.json").read_text()) for rank in (0, 1)]


def test_two_processes_sharing_a_job_each_write_their_shards_of_the_store_one_process_makes(two_ranks, tmp_path):
    root, corpus, ranks = two_ranks
    datasets = stored_datasets(corpus)
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


def test_parts_that_do_not_see_each_other_s_shards_stop_with_a_hint_and_finalize_nothing(two_ranks):
    root, _, _ = two_ranks
    for rank in (0, 1):
        message = (root / f"{rank}.err").read_text()
        assert f"part {rank} of 2 of a shared caching job does not see" in message and "s3://" in message
        assert not open_store(root / f"rank-{rank}" / "train", check_files=False).manifest["complete"]


def test_data_parallel_ranks_plan_with_the_slowest_rank_s_throughputs(two_ranks):
    """So that every rank makes the same plan."""
    for part in two_ranks[2]:
        agreed = part["agreed"]
        assert agreed.pop("step_seconds") == pytest.approx({"1": 0.3, "2": 0.4})
        assert agreed == pytest.approx(dict(layer_seconds=2e-3, write_bps=1e8, read_bps=3e8, store_overhead_s=0.05,
                                            build_layer_seconds=4e-3))
