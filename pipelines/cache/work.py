"""A caching job's planned work, one `SplitJob` per split (what the runners execute), and its tally."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from pipelines.data.batches import TokenSamples
from preinfer.boundary_state import BoundaryState
from storage import Fingerprint, Store


@dataclass
class SplitResult:
    """The outcome of one split: its store, size and what this run did."""

    name: str
    path: Path
    fingerprint: Fingerprint
    samples: int
    tokens: int
    num_shards: int
    shards_computed: int = 0
    shards_skipped: int = 0
    samples_computed: int = 0
    bytes_written: int = 0
    stored_bytes: int = 0


@dataclass
class SplitJob:
    """One split's planned work: its store, the inputs of its samples, the shards still to do and its result."""

    name: str
    store: Store
    inputs: Callable[[int, int], BoundaryState]
    start_layer: int
    result: SplitResult
    todo: list[int]
    source_path: Path | None = None  # roll-forward (Dask tasks read it themselves)
    source_digest: str | None = None
    dataset: TokenSamples | None = None

    @property
    def seq_len(self) -> int:
        """Tokens per sample of the split's states."""
        return self.store.fields["hidden"].shape[0]

    def todo_samples(self) -> int:
        """Samples of the shards still to do."""
        return sum(hi - lo for lo, hi in map(self.store.shard_range, self.todo))

    def shard_done(self, shard: int, nbytes: int) -> int:
        """Count shard `shard` (of `nbytes` on disk) as computed; returns its sample count."""
        lo, hi = self.store.shard_range(shard)
        self.result.shards_computed += 1
        self.result.samples_computed += hi - lo
        self.result.bytes_written += nbytes
        return hi - lo


# A shard that failed: (split, shard, why in one line).
Failure = tuple[str, int, str]
