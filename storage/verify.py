"""`verify(path)`: check every shard of a store and report all problems in plain words."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from storage.api import open_store
from storage.errors import StorageError
from storage.shard_input import format_ranges


@dataclass
class ShardProblem:
    """One bad shard: its index, sample range and what is wrong."""

    shard: int
    samples: tuple[int, int]
    problem: str


@dataclass
class VerifyReport:
    """The outcome of `verify`: `ok` only if the manifest is sound and every shard is present and intact."""

    path: str
    manifest_error: str | None = None
    num_shards: int = 0
    checked: int = 0
    missing: list[int] = field(default_factory=list)
    bad: list[ShardProblem] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """Whether the store is complete and intact."""
        return self.manifest_error is None and not self.missing and not self.bad

    def __str__(self) -> str:
        if self.manifest_error:
            return f"store {self.path}: BAD manifest: {self.manifest_error}"
        lines = [f"store {self.path}: {'OK' if self.ok else 'BAD'}, {self.checked} of {self.num_shards} shards checked"]
        if self.missing:
            lines.append(f"  not written: shards {format_ranges(self.missing)}")
        lines += [f"  shard {p.shard} (samples {p.samples[0]}..{p.samples[1]}): {p.problem}" for p in self.bad]
        return "\n".join(lines)


def verify(path: str | os.PathLike) -> VerifyReport:
    """Read and checksum every shard of the store at `path`; never raises for a damaged store."""
    report = VerifyReport(str(path))
    try:
        store = open_store(path, check_files=False)
    except StorageError as err:
        report.manifest_error = str(err)
        return report
    report.num_shards = store.num_shards
    report.missing = store.missing_shards()
    damaged = store.damaged_shards()
    for i in store.completed_shards():
        report.checked += 1
        problem = damaged.get(i)
        if problem is None:
            try:
                store.read_shard(i)
            except StorageError as err:
                problem = str(err)
        if problem is None:
            problem = _error_problem(store.shard_encoding_error(i))
        if problem is not None:
            report.bad.append(ShardProblem(i, store.shard_range(i), problem))
    return report


def _error_problem(errors: dict[str, dict]) -> str | None:
    """What is wrong with the decoding error a lossy shard recorded (beyond its encoding's bound), or None."""
    beyond = [f"{name}: {stats['max_over_bound']:.3g} x its bound"
              for name, stats in errors.items() if not stats["max_over_bound"] <= 1 + 1e-6]  # float64 noise
    return f"decoding error recorded beyond the encoding's bound ({'; '.join(beyond)})" if beyond else None
