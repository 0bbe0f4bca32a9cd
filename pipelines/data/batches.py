"""Batch sources over stores: the one `preinfer.batch_source.BatchSource` every run, evaluation and test uses. Live
training reads its token batches from the token store on disk (`TokenShards`: its samples cut into the shards an
activation store of the run would have) and training from pre-inference reads boundary states from a disk store,
both through `storage`'s reader: with the same samples per shard they follow exactly the same sample order, and a
cursor taken from one resumes the other."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Protocol

import torch

import storage
from preinfer.batch_source import LiveSources
from preinfer.errors import PreinferError

TOKEN_FIELDS = ("input_ids", "attention_mask", "labels")


class NoBatchesError(PreinferError):
    """A store that yields no batch to this rank's reader (fewer samples than one batch)."""


class TokenSamples(Protocol):
    """Token samples by index (`pipelines.data.token_store.TokenStoreDataset`, or
    `pipelines.data.in_memory.TokenDataset`)."""

    @property
    def seq_len(self) -> int: ...

    @property
    def num_tokens(self) -> int: ...

    def fingerprint(self) -> str: ...

    def __len__(self) -> int: ...

    def __getitem__(self, index: slice) -> dict[str, torch.Tensor]: ...


class TokenShards:
    """Token samples seen as a complete store of `samples_per_shard`-sample shards of input_ids, attention_mask
    and labels (what `storage.Reader` reads), each shard decoded when it is read."""

    def __init__(self, dataset: TokenSamples, samples_per_shard: int, name: str = "tokens"):
        self.dataset, self.samples_per_shard, self.path = dataset, samples_per_shard, name
        seq_len = dataset.seq_len
        self.fields = {"input_ids": storage.FieldSpec((seq_len,), "int64"),
                       "attention_mask": storage.FieldSpec((seq_len,), "bool"),
                       "labels": storage.FieldSpec((seq_len,), "int64")}
        self._lock = threading.Lock()  # the reader decodes shards on threads; the dataset keeps a shard cache

    @property
    def num_samples(self) -> int:
        return len(self.dataset)

    @property
    def num_shards(self) -> int:
        return -(-self.num_samples // self.samples_per_shard)

    def require_complete(self) -> None:
        """A token dataset is always complete."""

    def shard_range(self, i: int) -> tuple[int, int]:
        start = i * self.samples_per_shard
        return start, min(start + self.samples_per_shard, self.num_samples)

    def read_shard(self, i: int, fields: list[str] | None = None, check: bool = True) -> dict[str, torch.Tensor]:
        start, stop = self.shard_range(i)
        with self._lock:
            tensors = self.dataset[start:stop]
        return {name: tensors[name] for name in fields or TOKEN_FIELDS}

    def will_read(self, i: int) -> None:
        """No read-ahead: the token store's shards are small."""


class ReaderBatches:
    """A `preinfer.batch_source.BatchSource` over a complete store at `boundary` (0: token shards)."""

    def __init__(self, store: storage.Store | TokenShards, boundary: int, batch_size: int, seed: int = 0, rank: int = 0,
                 world_size: int = 1, shuffle: bool = True, limit: int | None = None):
        self.store, self.boundary, self.limit = store, boundary, limit
        # lossy hidden states come decoded (float32; the trainer casts them to the compute dtype)
        decode = torch.float32 if isinstance(store, storage.Store) else None
        # token shards are cut from the token store's cached shards in the trainer's own thread: prefetching
        # threads would have nothing to decode and would compete with the compute for the cores (issue 12)
        prefetch = 0 if isinstance(store, TokenShards) else storage.Reader.PREFETCH
        self.options = dict(batch_size=batch_size, seed=seed, rank=rank, world_size=world_size, decode=decode,
                            prefetch=prefetch)
        self.reader = storage.Reader(store, shuffle=shuffle, **self.options)
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
        raise NoBatchesError(f"store {self.store.path} yields no batches")

    def one_pass(self) -> Iterator[dict[str, torch.Tensor]]:
        """Every sample once (the first `limit` ones if set) in stored order, on every rank, with a reader of its
        own (the training cursor is untouched)."""
        left = self.store.num_samples if self.limit is None else self.limit
        for batch in storage.Reader(self.store, self.options["batch_size"], shuffle=False,
                                    decode=self.options["decode"], prefetch=self.options["prefetch"]):
            if left <= 0:
                return
            batch = {name: tensor[:left] for name, tensor in batch.items()}
            left -= len(next(iter(batch.values())))
            yield batch

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


def token_batches(dataset: TokenSamples, batch_size: int, samples_per_shard: int, seed: int = 0, rank: int = 0,
                  world_size: int = 1, shuffle: bool = True) -> ReaderBatches:
    """Token batches of `dataset` (boundary 0), in the order of a store of `samples_per_shard`-sample shards."""
    name = f"tokens of {getattr(dataset, 'path', 'memory')} ({getattr(dataset, 'split', '')})"
    return ReaderBatches(TokenShards(dataset, samples_per_shard, name), 0, batch_size, seed, rank, world_size,
                         shuffle)


def live_sources(train: TokenSamples, evaluation: TokenSamples, batch_size: int, samples_per_shard: int,
                 seed: int = 0, rank: int = 0, world_size: int = 1) -> LiveSources:
    """Token batches read through the same reader (and so in the same order) as boundary stores would be: the
    training split shuffled by `seed` and split across ranks, the eval split whole and in order."""
    return LiveSources(token_batches(train, batch_size, samples_per_shard, seed, rank, world_size),
                       token_batches(evaluation, batch_size, samples_per_shard, seed, shuffle=False))
