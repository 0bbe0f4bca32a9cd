"""The stores of boundary states a run with pre-inference has made: kept by boundary while their fingerprint matches
the current prefix, made (from the input, or rolled forward from a lower store) by the run's `StoreWriter` with the
same code as `preinfer cache`, and deleted when no longer usable or no longer read (unless `keep_stores`)."""

from __future__ import annotations

import contextlib
import re
import time
from collections.abc import Callable, Iterator

import torch.distributed as dist

from preinfer.config import Config
from preinfer.errors import UsageError
from preinfer.metrics import CacheRecord, Record
from preinfer.staged import StagedModel
from pipelines.cache import CacheOptions, cache_fingerprint, open_cache
from pipelines.pre_inference.writers import Built, StoreWriter
from pipelines.jobs.output import held_output
from storage import Location, StorageError, location, remove_tree


STORE_NAME = re.compile(r"(boundary-|probe-rank)\d+")  # what pre-inference writes under its store directory


def check_store_dir(root: Location) -> None:
    """Refuse a store directory that is a file or holds anything pre-inference does not write there (its stores,
    its probes)."""
    if root.exists() and not root.is_dir():
        raise UsageError(f"--store-dir {root} is a file, not a directory")
    if not root.is_dir():
        return
    foreign = sorted(p.name for p in root.iterdir() if not p.name.startswith(".") and not STORE_NAME.fullmatch(p.name))
    if foreign:
        raise UsageError(f"--store-dir {root} holds {foreign[0]!r}, which pre-inference does not write; choose an "
                         f"empty or new directory, nothing was deleted")


def owning_store_dir(config: Config, rank: int = 0) -> contextlib.AbstractContextManager:
    """Hold a `--store-dir` of the run's (rank 0, for every rank) for the whole run, like every other output, so
    that a second run on it is refused naming the holder; the default under the run directory is the run's."""
    store_dir = config.pre_inference.store_dir
    if store_dir is None or rank != 0:
        return contextlib.nullcontext()
    check_store_dir(location(store_dir))  # a file in its place, or a user's files: this line, not the lock's
    return held_output(store_dir, "--store-dir")


class Stores:
    """The stores under `root` believed valid, by boundary, made by `writer`; `rank` of `world`: the processes
    that read them (rank 0 deletes them)."""

    def __init__(self, staged: StagedModel, datasets: dict, tokenizer, config: Config, root: Location,
                 options: CacheOptions, emit: Callable[[Record], None], writer: StoreWriter, rank: int = 0,
                 world: int = 1):
        self.staged, self.datasets, self.tokenizer, self.config = staged, datasets, tokenizer, config
        self.root, self.options, self.emit, self.writer = root, options, emit, writer
        self.rank, self.world = rank, world
        self.paths: dict[int, Location] = {}  # boundary -> cache directory believed valid

    def __contains__(self, boundary: int) -> bool:
        return boundary in self.paths

    def __iter__(self) -> Iterator[int]:
        return iter(self.paths)

    def valid(self) -> list[int]:
        """The boundaries whose store matches the current prefix."""
        return [b for b in self.paths if self.is_valid(b)]

    def is_valid(self, boundary: int) -> bool:
        expected = cache_fingerprint(self.staged, self.datasets["train"], self.tokenizer, boundary,
                                     self.config.pre_inference.store_dtype,
                                     prefix=self.writer.prefix_digest(boundary))  # first: it may be a collective
        try:
            stores = open_cache(self.paths[boundary], splits=["train"])
        except StorageError:  # damaged or half-deleted: not usable, rebuilt on demand
            return False
        return stores["train"].fingerprint.digest == expected.digest

    def ensure(self, boundary: int, source: int | None = None) -> tuple[Location, Built | None, int]:
        """A valid store at `boundary`: reused, or made from `source` (0: the input) if that is still valid, else
        rolled forward from the nearest valid lower one (when the writer rolls forward), or made from the input.
        Returns its path, and for a store made here what making it measured and the boundary it was made from
        (None and 0 for one reused)."""
        if boundary in self.paths and self.is_valid(boundary):
            self.emit(CacheRecord(boundary=boundary, how="reuse", seconds=0.0, bytes=0))
            return self.paths[boundary], None, 0
        out = self.root / f"boundary-{boundary}"
        valid = [b for b in self.valid() if b < boundary] if self.writer.rolls_forward else []
        if source not in (0, *valid):
            source = max(valid, default=0)
        built = self.writer.write(boundary, self.paths[source] if source else None, out, self.options)
        self.paths[boundary] = out
        self.emit(CacheRecord(boundary=boundary, how="roll_forward" if source else "input", from_=source,
                              seconds=built.seconds, bytes=built.stored_bytes))
        return out, built, source

    def delete(self, boundary: int, reason: str) -> float | None:
        """Forget the store at `boundary` and delete it unless `keep_stores`; the seconds deleting took (None:
        kept)."""
        path = self.paths.pop(boundary)
        if self.config.pre_inference.keep_stores:
            return None
        if self.world > 1:
            dist.barrier()  # no rank reads it any more
        started = time.perf_counter()
        if self.rank == 0:
            remove_tree(path)
        seconds = time.perf_counter() - started
        self.emit(CacheRecord(boundary=boundary, how="deleted", reason=reason, seconds=seconds, bytes=0))
        return seconds
