"""What a caching job reports: `CacheResult`, or a `CacheJobError` naming the shards that failed."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from preinfer.errors import PreinferError, is_disk_full
from storage import Fingerprint
from pipelines.cache.shards import one_line
from pipelines.cache.work import Failure, SplitJob, SplitResult


class CacheJobError(PreinferError):
    """Shards failed at run time; every shard finished before stays intact, and rerunning resumes the job."""


@dataclass
class CacheResult:
    """The outcome of a caching job over all its splits."""

    path: Path
    boundary: int
    splits: dict[str, SplitResult]
    samples: int
    tokens: int
    bytes_written: int
    seconds: float
    shards_computed: int
    shards_skipped: int
    source_boundary: int = 0  # 0: from the input; K: rolled forward from a store at boundary K
    store_dtype: str = ""
    store_format: str = ""
    workers: str = "1"
    model_loads: dict[str, int] = field(default_factory=dict)  # Dask: model loads per worker
    # Where the time went (summed over shards; with Dask, over tasks on all workers): the forward and host copies,
    # writing (encode, checksum, fsync, publish), and the forward thread blocked on a full queue (writing slower
    # than computing). The measured throughputs a cost model needs.
    forward_seconds: float = 0.0
    write_seconds: float = 0.0
    blocked_seconds: float = 0.0

    @property
    def fingerprints(self) -> dict[str, Fingerprint]:
        return {name: split.fingerprint for name, split in self.splits.items()}

    @property
    def stored_bytes(self) -> int:
        """Bytes the stores take on disk, whoever wrote them."""
        return sum(s.stored_bytes for s in self.splits.values())

    @property
    def samples_computed(self) -> int:
        """Samples this run computed and wrote (not those already stored, nor another part's)."""
        return sum(s.samples_computed for s in self.splits.values())

    @property
    def tokens_per_s(self) -> float:
        computed = sum(s.tokens * s.shards_computed / s.num_shards for s in self.splits.values())
        return computed / self.seconds if self.seconds > 0 else 0.0

    def summary(self) -> str:
        what = f"rolled forward {self.source_boundary}->{self.boundary}" if self.source_boundary else \
            f"boundary {self.boundary}"
        if not self.shards_computed:
            return (f"{self.path}: {what} already complete ({self.samples:,} samples, "
                    f"{self.shards_skipped} shards), nothing to do")
        skipped = f", {self.shards_skipped} already done" if self.shards_skipped else ""
        return (
            f"{self.path}: {what}, {self.samples:,} samples ({self.tokens:,} tokens) in "
            f"{', '.join(self.splits) or '-'}; {self.shards_computed} shards computed{skipped}; "
            f"{self.bytes_written / 2**20:.1f} MiB written ({self.store_format}, {self.store_dtype}) in "
            f"{self.seconds:.1f} s, {self.tokens_per_s:,.0f} tokens/s"
        )


def failure(jobs: list[SplitJob], failed: list[Failure], fatal: BaseException | None,
            where: str | Path | None = None) -> CacheJobError:
    """The error of a job whose shards `failed` or that `fatal` stopped (writing `where`: by default the first
    split's store), saying what is intact and how to resume."""
    done = sum(len(job.store.completed_shards()) for job in jobs)
    total = sum(job.store.num_shards for job in jobs)
    intact = f"{done} of {total} shards are finished and intact; rerun the same command to resume"
    if fatal is not None:
        if is_disk_full(fatal):
            return CacheJobError(f"disk full while writing the cache in {where or jobs[0].store.path}: "
                                 f"{one_line(fatal)}. Free space, then {intact[0].lower()}{intact[1:]}")
        return CacheJobError(f"{one_line(fatal)}. {intact}")
    by_name = {job.name: job for job in jobs}
    names = []
    for split, shard, _ in failed:
        lo, hi = by_name[split].store.shard_range(shard)
        names.append(f"{split + ' ' if split else ''}shard {shard} (samples {lo}..{hi})")
    return CacheJobError(
        f"{len(failed)} shard{'s' if len(failed) > 1 else ''} failed: {', '.join(names[:10])}"
        f"{' ...' if len(names) > 10 else ''} ({failed[0][2]}); {intact}")
