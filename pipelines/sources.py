"""Batch sources over stores: the one `preinfer.sources.BatchSource` every run, evaluation and test uses. Live
training reads its token batches from a memory store and training from pre-inference reads boundary states from
a disk store, both through `storage`'s reader: with the same samples per shard they follow exactly the same
sample order, and a cursor taken from one resumes the other."""

from __future__ import annotations

from collections.abc import Iterator

import torch

import storage
from preinfer.data import TokenDataset
from preinfer.sources import LiveSources

TOKEN_FIELDS = ("input_ids", "attention_mask", "labels")


class ReaderBatches:
    """A `preinfer.sources.BatchSource` over a complete store at `boundary` (0: a token store)."""

    def __init__(self, store: storage.Store, boundary: int, batch_size: int, seed: int = 0, rank: int = 0,
                 world_size: int = 1, shuffle: bool = True):
        self.store, self.boundary = store, boundary
        # lossy hidden states come decoded (float32; the trainer casts them to the compute dtype)
        self.options = dict(batch_size=batch_size, seed=seed, rank=rank, world_size=world_size, decode=torch.float32)
        self.reader = store.reader(shuffle=shuffle, **self.options)
        self._batches: Iterator | None = None

    @property
    def batches_per_epoch(self) -> int:
        return len(self.reader)

    def __iter__(self) -> ReaderBatches:
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        for _ in range(2):  # at the end of an epoch the reader's next iteration is the next epoch
            if self._batches is None:
                self._batches = iter(self.reader)
            batch = next(self._batches, None)
            if batch is not None:
                return batch
            self._batches = None
        raise RuntimeError(f"store {self.store.path} yields no batches")

    def one_pass(self) -> Iterator[dict[str, torch.Tensor]]:
        """Every sample once in stored order, on every rank, with a reader of its own (the training cursor is
        untouched)."""
        yield from self.store.reader(self.options["batch_size"], shuffle=False, decode=torch.float32)

    def state_dict(self) -> dict:
        return self.reader.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.close()
        self.reader.load_state_dict(state)

    def close(self) -> None:
        """Stop the reader's prefetching threads."""
        if self._batches is not None:
            self._batches.close()
            self._batches = None


def token_store(dataset: TokenDataset, samples_per_shard: int) -> storage.Store:
    """The dataset's token batches as a memory store (shared by name, so building it twice costs nothing)."""
    digest = dataset.fingerprint()
    n, t = dataset.input_ids.shape
    name = f"tokens-{digest[:20]}-{samples_per_shard}"
    fields = {k: ((t,), getattr(dataset, k).dtype) for k in TOKEN_FIELDS}
    store = storage.create_store(name, fields, n, samples_per_shard, storage.Fingerprint(digest, {"dataset": digest}),
                                 format="memory")
    for shard in store.missing_shards():
        start, stop = store.shard_range(shard)
        store.write_shard(shard, {k: getattr(dataset, k)[start:stop] for k in TOKEN_FIELDS})
    store.finalize()
    return store


def token_batches(dataset: TokenDataset, batch_size: int, samples_per_shard: int, seed: int = 0, rank: int = 0,
                  world_size: int = 1, shuffle: bool = True) -> ReaderBatches:
    """Token batches of `dataset` (boundary 0) through a memory token store."""
    return ReaderBatches(token_store(dataset, samples_per_shard), 0, batch_size, seed, rank, world_size, shuffle)


def live_sources(train: TokenDataset, evaluation: TokenDataset, batch_size: int, samples_per_shard: int,
                 seed: int = 0, rank: int = 0, world_size: int = 1) -> LiveSources:
    """Token batches read through the same reader (and so in the same order) as boundary stores would be: the
    training split shuffled by `seed` and split across ranks, the eval split whole and in order."""
    return LiveSources(token_batches(train, batch_size, samples_per_shard, seed, rank, world_size),
                       token_batches(evaluation, batch_size, samples_per_shard, seed, shuffle=False))
