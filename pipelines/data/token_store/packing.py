"""The pack step of a tokenize job: each split's samples cut from the staged chunks, in corpus order, and written
shard by shard into its store."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch

import storage
from pipelines.data.sample_blocks import SampleBlock, SamplePacker
from pipelines.data.samples import SPLITS
from pipelines.data.token_store.layout import SplitInfo, store_fields
from pipelines.data.token_store.options import TokenizeOptions
from pipelines.data.token_store.staging import Staging

CODEC = "zstd"  # token ids compress better unshuffled (see bench/data.py)


class Packing:
    """Writes each split's samples from the staged chunks into its store, shard by shard."""

    def __init__(
        self, options: TokenizeOptions, fingerprint: storage.Fingerprint, staging: Staging, encoded: dict[str, Any],
        dtype: np.dtype, per_shard: int,
    ) -> None:
        self.options, self.fingerprint, self.staging = options, fingerprint, staging
        self.chunks, self.kind = int(encoded["chunks"]), encoded["kind"]
        self.dtype, self.per_shard = dtype, per_shard
        self.shards_written = 0

    def _samples(self, counts: list[dict[str, int]]) -> int:
        units = sum(count["units"] for count in counts)
        return units if self.kind != "lm" else units // self.options.seq_len

    def has_samples(self) -> bool:
        """Whether any split will have samples."""
        return any(self._samples(self._counts(split)) for split in SPLITS)

    def _counts(self, split: str) -> list[dict[str, int]]:
        return [self.staging.counts(index)[split] for index in range(self.chunks)]

    def pack(self, path: Path, split: str) -> SplitInfo:
        """Write the store of `split` at `path` (the shards it lacks) and finalize it."""
        counts = self._counts(split)
        samples = self._samples(counts)
        store = None
        if samples:
            fields = store_fields(self.kind, self.options.seq_len, self.dtype)
            store = storage.create_store(path, fields, samples, self.per_shard, self.fingerprint, codec=CODEC)
        done = set(store.completed_shards()) if store is not None else set()
        packer = SamplePacker(self.options.seq_len, self.kind, self.per_shard)
        tokens = 0
        for shard, block in enumerate(self._blocks(packer, split, counts)):
            tokens += block.tokens
            if shard not in done:
                store.write_shard(shard, _shard_tensors(block))
                self.shards_written += 1
        problem = packer.report(f"{self.options.data} ({split})")
        if store is not None:
            store.finalize()
        return SplitInfo(packer.samples, tokens, packer.documents, problem, packer.truncated, packer.skipped)

    def _blocks(self, packer: SamplePacker, split: str, counts: list[dict[str, int]]) -> Iterable[SampleBlock]:
        for index, count in enumerate(counts):
            yield from packer.add(self.staging.read_split(index, split, count))
        yield from packer.finish()


def _shard_tensors(block: SampleBlock) -> dict[str, torch.Tensor]:
    tensors = {"ids": torch.from_numpy(np.ascontiguousarray(block.ids))}
    if block.lengths is not None:
        tensors["lengths"] = torch.from_numpy(np.ascontiguousarray(block.lengths, dtype=np.int32))
    if block.label_mask is not None:
        tensors["label_mask"] = torch.from_numpy(np.ascontiguousarray(block.label_mask, dtype=np.uint8))
    return tensors
