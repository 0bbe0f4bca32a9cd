"""The trainer's reader: exactly-once epochs, seeded orders, exact resume, rank split, prefetch (issue 3)."""

from __future__ import annotations

import threading
import uuid

import pytest
import torch

from storage import Fingerprint, StorageError, create_store
from storage.errors import CorruptStoreError

N, S = 37, 5  # 8 shards, the last one holds 2 samples


def make_store(backend: str = "memory", tmp_path=None, num_samples: int = N, samples_per_shard: int = S):
    path = str(tmp_path / "s") if tmp_path is not None else f"mem-{uuid.uuid4().hex}"
    store = create_store(
        path, fields={"index": ((), torch.int64), "hidden": ((2, 3), torch.bfloat16)}, num_samples=num_samples,
        samples_per_shard=samples_per_shard, fingerprint=Fingerprint("d"), format=backend,
    )
    for i in range(store.num_shards):
        start, stop = store.shard_range(i)
        index = torch.arange(start, stop)
        store.write_shard(i, {"index": index, "hidden": index[:, None, None].expand(-1, 2, 3).bfloat16()})
    store.finalize()
    return store


def indices(batches) -> list[int]:
    return [i for batch in batches for i in batch["index"].tolist()]


@pytest.fixture(scope="module")
def store():
    return make_store()


@pytest.mark.parametrize("prefetch", [0, 3])
@pytest.mark.parametrize("backend", ["memory", "zarr", "safetensors"])
def test_every_sample_once_per_epoch(tmp_path, backend, prefetch):
    store = make_store(backend, tmp_path)
    reader = store.reader(batch_size=4, seed=3, prefetch=prefetch)
    assert len(reader) == 10  # ceil(37 / 4)
    epochs = []
    for epoch in range(3):
        assert reader.epoch == epoch
        batches = list(reader)
        assert len(batches) == 10 and [len(b["index"]) for b in batches][-1] == 1
        assert all(b["hidden"].dtype == torch.bfloat16 and b["hidden"].shape[1:] == (2, 3) for b in batches)
        assert all(torch.equal(b["hidden"][:, 0, 0].long(), b["index"]) for b in batches)
        order = indices(batches)
        assert sorted(order) == list(range(N))
        epochs.append(order)
    assert reader.epoch == 3
    assert epochs[0] != epochs[1] != epochs[2] != epochs[0]


def test_orders_depend_on_seed_only(store):
    first = indices(store.reader(6, seed=1))
    assert first == indices(store.reader(6, seed=1, prefetch=0, threads=1))
    assert first != indices(store.reader(6, seed=2))
    assert first != list(range(N))


def test_shuffle_false_is_sequential_and_drop_last(store):
    reader = store.reader(8, shuffle=False, drop_last=True)
    assert len(reader) == 4
    assert indices(reader) == list(range(32))
    assert indices(store.reader(8, shuffle=False)) == list(range(N))


@pytest.mark.parametrize("prefetch", [0, 2])
@pytest.mark.parametrize("stop_after", [0, 3, 9, 10, 14])  # 10 batches per epoch: mid, last, next epoch
def test_resume_yields_exactly_the_remaining_batches(store, prefetch, stop_after):
    full = store.reader(4, seed=5, prefetch=prefetch)
    reference = [indices([b]) for _ in range(2) for b in full]
    reader = store.reader(4, seed=5, prefetch=prefetch)
    taken = []
    while len(taken) < stop_after:
        for batch in reader:
            taken.append(indices([batch]))
            if len(taken) == stop_after:
                break
    state = reader.state_dict()
    resumed = store.reader(4, seed=5, prefetch=prefetch)
    resumed.load_state_dict(state)
    assert resumed.epoch == stop_after // 10
    rest = []
    while resumed.epoch < 2:
        rest += [indices([b]) for b in resumed]
    assert taken + rest == reference


def test_resume_refuses_other_settings(store):
    state = store.reader(4, seed=5).state_dict()
    with pytest.raises(StorageError, match="cannot resume a state with seed=5, this reader has seed=6"):
        store.reader(4, seed=6).load_state_dict(state)
    with pytest.raises(StorageError, match="batch_size=4"):
        store.reader(8, seed=5).load_state_dict(state)


@pytest.mark.parametrize("world_size", [2, 3, 5])
def test_ranks_are_disjoint_and_cover_all(store, world_size):
    for epoch_seed in (0, 1):
        per_rank = [indices(store.reader(3, seed=epoch_seed, rank=r, world_size=world_size)) for r in range(world_size)]
        flat = [i for order in per_rank for i in order]
        assert sorted(flat) == list(range(N))  # disjoint and complete
        sizes = [len(order) for order in per_rank]
        assert max(sizes) - min(sizes) <= 1
        lengths = [len(store.reader(3, rank=r, world_size=world_size)) for r in range(world_size)]
        assert max(lengths) - min(lengths) <= 1


def test_rank_slices_follow_the_global_order(store):
    whole = [i for b in store.reader(1, seed=4) for i in b["index"].tolist()]
    split = [i for r in range(3) for b in store.reader(1, seed=4, rank=r, world_size=3) for i in b["index"].tolist()]
    assert split == whole


def test_bad_reader_arguments(store):
    with pytest.raises(StorageError, match="0 <= rank < world_size"):
        store.reader(4, rank=2, world_size=2)
    with pytest.raises(StorageError, match="batch_size > 0"):
        store.reader(0)
    with pytest.raises(StorageError, match="seed >= 0, got .*seed=-3"):  # numpy's generators take none (the fuzzer)
        store.reader(4, seed=-3)


def test_a_failure_planning_the_epoch_reaches_the_consumer_not_a_hang(store, monkeypatch):
    """The fuzzer's hang: the background thread died planning the epoch and the consumer waited for ever."""
    def failing(self, epoch, first):
        raise ValueError("planning failed")
        yield

    monkeypatch.setattr(type(store.reader(4)), "_batches", failing)
    result: list = []
    worker = threading.Thread(target=lambda: result.append(pytest.raises(ValueError, list, store.reader(4))),
                              daemon=True)
    worker.start()
    worker.join(timeout=20)
    assert not worker.is_alive() and result and "planning failed" in str(result[0].value)


def test_breaking_early_stops_the_background_thread(store):
    before = threading.active_count()
    reader = store.reader(2, seed=0, prefetch=2, threads=2)
    for _ in zip(range(3), reader):
        pass
    assert threading.active_count() == before
    assert reader.state_dict()["batch"] == 3


def test_corrupt_shard_raises_from_iteration(tmp_path):
    store = make_store("safetensors", tmp_path)
    target = tmp_path / "s" / "shards" / "shard-000003.safetensors"
    raw = bytearray(target.read_bytes())
    raw[-3] ^= 1
    target.write_bytes(bytes(raw))
    with pytest.raises(CorruptStoreError, match=r"shard 3 \(samples 15\.\.20\)"):
        list(store.reader(4, shuffle=False, prefetch=2))


def test_pin_memory_without_accelerator_warns(store):
    if torch.cuda.is_available():
        batch = next(iter(store.reader(4, pin_memory=True)))
        assert batch["index"].is_pinned()
    else:
        with pytest.warns(UserWarning, match="pin_memory=True ignored"):
            store.reader(4, pin_memory=True)


@pytest.mark.parametrize("prefetch", [0, 2])
@pytest.mark.parametrize("batch_size", [3, 12])  # within a shard, and spanning several shards
def test_each_shard_is_read_once_per_epoch(monkeypatch, prefetch, batch_size):
    store = make_store()
    reads = []
    real = type(store).read_shard
    monkeypatch.setattr(type(store), "read_shard", lambda self, i, *a, **k: reads.append(i) or real(self, i, *a, **k))
    reader = store.reader(batch_size, seed=2, prefetch=prefetch, rank=1, world_size=2)
    order = indices(reader)
    assert sorted(reads) == sorted(set(reads)) and len(reads) == len({i // S for i in order})
