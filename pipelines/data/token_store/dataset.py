"""One split of a token store, read lazily: the batches of `pipelines.data.in_memory.TokenDataset` for any index,
decoding only the shards that hold the samples asked for (a few recent shards stay decoded)."""

from __future__ import annotations

import hashlib
import json
import operator
from collections import OrderedDict
from pathlib import Path

import numpy as np
import torch

import storage
from pipelines.data.token_store.layout import INFO, TokenStoreInfo, read_info
from pipelines.data.sample_blocks import SampleBlock
from pipelines.data.samples import SPLITS
from preinfer.errors import UsageError


def open_token_store(path: str | Path, expect: storage.Fingerprint | None = None) -> TokenStoreInfo:
    """The description of the complete token store at `path`; refused in one line when there is none, or when
    `expect` is given and the store was built for another fingerprint."""
    root = Path(path)
    info = read_info(root)
    if info is None:
        raise UsageError(f"no complete token store at {root} ({INFO} not found); build it with preinfer tokenize")
    if expect is not None and info.digest != expect.digest:
        differences = "; ".join(info.store_fingerprint.differences(expect)) or "another fingerprint"
        raise UsageError(f"the token store at {root} was built for another corpus or setting ({differences})")
    return info


class TokenStoreDataset:
    """A split of the token store at `path`, with `TokenDataset`'s interface: `dataset[index]` is a dict of
    input_ids (int64), attention_mask (bool) and labels (int64), each [len(index), seq_len]."""

    def __init__(
        self, path: str | Path, split: str, expect: storage.Fingerprint | None = None, cached_shards: int = 2,
        limit: int | None = None,
    ) -> None:
        if split not in SPLITS:
            raise UsageError(f"split must be one of {', '.join(SPLITS)}, got '{split}'")
        self.path, self.split = Path(path), split
        self.info = open_token_store(self.path, expect)
        described = self.info.splits[split]
        if described.problem:
            raise UsageError(described.problem)
        self.store = storage.open_store(self.path / split, expect_fingerprint=self.info.store_fingerprint)
        self.store.require_complete()
        self._length = self.store.num_samples if limit is None else min(limit, self.store.num_samples)
        self._dtype = np.dtype(self.info.id_dtype)
        self._cached_shards = max(1, cached_shards)
        self._shards: OrderedDict[int, SampleBlock] = OrderedDict()

    def __len__(self) -> int:
        return self._length

    def __getstate__(self) -> dict:
        """What a process needs to open the same samples itself (a Dask task carries this, never the samples)."""
        return {"path": self.path, "split": self.split, "limit": self._length, "cached_shards": self._cached_shards}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["path"], state["split"], cached_shards=state["cached_shards"], limit=state["limit"])

    @property
    def seq_len(self) -> int:
        return self.info.seq_len

    @property
    def source(self) -> str:
        """The corpus as it was given to `preinfer tokenize`."""
        return str(self.info.fingerprint["parts"].get("corpus", self.path))

    @property
    def num_tokens(self) -> int:
        """Real (unpadded) tokens of the whole split."""
        if self._length == self.store.num_samples:
            return self.info.splits[self.split].tokens
        if self.info.kind == "lm":  # every position of LM text is a real token
            return self._length * self.seq_len
        per_shard = self.store.samples_per_shard
        return sum(int(self.block(np.arange(start, min(start + per_shard, self._length))).lengths[:, 1].sum())
                   for start in range(0, self._length, per_shard))

    def head(self, n: int) -> TokenStoreDataset:
        """The first `n` samples as a dataset of their own."""
        return TokenStoreDataset(self.path, self.split, cached_shards=self._cached_shards, limit=min(n, len(self)))

    def fingerprint(self) -> str:
        """sha256 hex naming these samples: the token store's fingerprint, the split and the sample count (equal
        inputs give equal samples, so the samples themselves need not be read)."""
        record = {"token_store": self.info.digest, "split": self.split, "samples": len(self)}
        return hashlib.sha256(json.dumps(record, sort_keys=True).encode()).hexdigest()

    def __getitem__(self, index: int | slice | list | torch.Tensor) -> dict[str, torch.Tensor]:
        """The samples at `index` (int, slice, list or index tensor); the batch axis is kept ([1, T] for an int)."""
        return self.block(self._positions(index)).tensors()

    def _positions(self, index: int | slice | list | torch.Tensor) -> np.ndarray:
        if isinstance(index, slice):
            return np.arange(len(self))[index]
        if isinstance(index, torch.Tensor):
            if index.dtype == torch.bool or index.is_floating_point():
                raise TypeError(f"index tensors must hold integers, got {index.dtype}")
            index = index.tolist()
        if isinstance(index, list):
            positions = np.asarray(index, dtype=np.int64).reshape(-1)
        else:
            positions = np.asarray([operator.index(index)], dtype=np.int64)
        outside = positions[(positions < -len(self)) | (positions >= len(self))]
        if outside.size:
            raise IndexError(f"sample {int(outside[0])} out of range for {len(self)} samples")
        return positions % max(len(self), 1)

    def block(self, positions: np.ndarray) -> SampleBlock:
        """The samples at `positions` (in range, in any order) in compact form, read shard by shard."""
        per_shard = self.store.samples_per_shard
        shard_of = positions // per_shard
        ids = np.empty((len(positions), self.seq_len), dtype=self._dtype)
        lengths = np.empty((len(positions), 2), dtype=np.int32) if self.info.kind != "lm" else None
        label_mask = np.empty((len(positions), self.seq_len), np.uint8) if self.info.kind == "chat" else None
        for shard in np.unique(shard_of).tolist():
            rows = np.flatnonzero(shard_of == shard)
            stored = self._shard(shard)
            within = positions[rows] - shard * per_shard
            ids[rows] = stored.ids[within]
            if lengths is not None:
                lengths[rows] = stored.lengths[within]
            if label_mask is not None:
                label_mask[rows] = stored.label_mask[within]
        return SampleBlock(ids, lengths, label_mask)

    def _shard(self, shard: int) -> SampleBlock:
        """Shard `shard` decoded to compact form, from the few kept or read now."""
        if shard in self._shards:
            self._shards.move_to_end(shard)
            return self._shards[shard]
        tensors = self.store.read_shard(shard)
        ids = tensors["ids"].numpy()
        lengths, label_mask = (tensors[name].numpy() if name in tensors else None for name in ("lengths", "label_mask"))
        self._shards[shard] = SampleBlock(ids, lengths, label_mask)
        while len(self._shards) > self._cached_shards:
            self._shards.popitem(last=False)
        return self._shards[shard]
