"""The trainer's batch reader: seeded shuffling, exact resume, rank split, background prefetch.

Order of one epoch: the shards are permuted (seed, epoch), and the samples within each shard are permuted; the
concatenation is the epoch's global order (with `shuffle=False`: shard 0, 1, ... and samples in stored order).

Rank split: rank r of W takes the contiguous slice [floor(r*n/W), floor((r+1)*n/W)) of the global order, so ranks
are disjoint, cover every sample, and get sample counts that differ by at most one (batch counts by at most one
when the counts do not divide by the batch size; `drop_last=True` drops each rank's last partial batch). Each rank
reads about 1/W of the shards; a shard cut by a slice border is read by both neighbouring ranks.
"""

from __future__ import annotations

import functools
import queue
import threading
import warnings
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Iterator, Protocol

import numpy as np
import torch

from storage.dtypes import to_numpy
from storage.encodings import SCALE_SUFFIX
from storage.errors import StorageError
from storage.manifest import FieldSpec


class ShardedStore(Protocol):
    """What the reader needs of a store (`storage.Store` has it; the store module imports this one)."""

    path: str
    fields: dict[str, FieldSpec]
    encodings: dict

    @property
    def num_samples(self) -> int: ...

    @property
    def num_shards(self) -> int: ...

    def require_complete(self) -> None: ...

    def shard_range(self, i: int) -> tuple[int, int]: ...

    def read_shard(self, i: int, fields: list[str] | None = None, check: bool = True) -> dict[str, torch.Tensor]: ...

    def will_read(self, i: int) -> None: ...

    def decode(self, tensors: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]: ...

_END = object()


class _Failure:
    def __init__(self, error: BaseException) -> None:
        self.error = error


class Reader:
    """Batches `{field: tensor}` over a complete store; iterate it for the rest of the current epoch. With
    `decode` (a torch dtype) lossy fields come decoded into that dtype, without their scale fields; otherwise
    every field comes as stored. `prefetch` batches are assembled ahead by a background thread (0: in the
    caller's thread, when it asks for them; the order is the same)."""

    PREFETCH = 4

    def __init__(
        self,
        store: ShardedStore,
        batch_size: int,
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
        shuffle: bool = True,
        drop_last: bool = False,
        fields: list[str] | None = None,
        threads: int = 2,
        prefetch: int = PREFETCH,
        pin_memory: bool = False,
        check: bool = True,
        decode: torch.dtype | None = None,
    ) -> None:
        store.require_complete()
        if batch_size <= 0 or world_size <= 0 or not 0 <= rank < world_size or seed < 0:
            raise StorageError(
                f"reader of {store.path}: need batch_size > 0, 0 <= rank < world_size and seed >= 0, "
                f"got batch_size={batch_size}, rank={rank}, world_size={world_size}, seed={seed}"
            )
        self.store, self.batch_size, self.seed = store, int(batch_size), int(seed)
        self.rank, self.world_size, self.shuffle, self.drop_last = rank, world_size, shuffle, drop_last
        self.fields = list(store.fields) if fields is None else list(fields)
        self.decode = decode
        if decode is not None:  # a lossy field's scale is read with it
            scales = [name + SCALE_SUFFIX for name in store.encodings if name in self.fields]
            self.fields += [name for name in scales if name not in self.fields]
        self.threads, self.prefetch, self.check = max(1, threads), max(0, prefetch), check
        self.pin_memory = pin_memory and torch.cuda.is_available()
        if pin_memory and not self.pin_memory:
            warnings.warn("pin_memory=True ignored: no CUDA/ROCm device is available", stacklevel=2)
        n = store.num_samples
        self._lo, self._hi = rank * n // world_size, (rank + 1) * n // world_size
        self.epoch, self._batch = 0, 0

    # ---- order -------------------------------------------------------------------------------------------------
    @property
    def num_samples(self) -> int:
        """Samples this rank reads per epoch."""
        return self._hi - self._lo

    def __len__(self) -> int:
        """Batches this rank yields per epoch."""
        full, rest = divmod(self.num_samples, self.batch_size)
        return full + (1 if rest and not self.drop_last else 0)

    def order(self, epoch: int) -> list[tuple[int, np.ndarray]]:
        """This rank's samples of `epoch` as (shard, in-shard indices) runs, in reading order."""
        store = self.store
        rng = np.random.default_rng([self.seed, epoch]) if self.shuffle else None
        shards = rng.permutation(store.num_shards) if rng is not None else range(store.num_shards)
        runs, pos = [], 0
        for shard in shards:
            start, stop = store.shard_range(int(shard))
            count = stop - start
            lo, hi = max(self._lo - pos, 0), min(self._hi - pos, count)
            if lo < hi:
                local = rng.permutation(count) if rng is not None else np.arange(count)
                runs.append((int(shard), local[lo:hi]))
            elif rng is not None:
                rng.permutation(count)  # keep the stream identical for every rank
            pos += count
        return runs

    def _batches(self, epoch: int, first: int) -> Iterator[list[tuple[int, np.ndarray]]]:
        """The (shard, indices) pieces of each batch of `epoch` from batch `first` on."""
        skip, pieces, size = first * self.batch_size, [], 0
        for shard, idx in self.order(epoch):
            if skip >= len(idx):
                skip -= len(idx)
                continue
            idx, skip = idx[skip:], 0
            while len(idx):
                take = idx[: self.batch_size - size]
                pieces.append((shard, take))
                size += len(take)
                idx = idx[len(take):]
                if size == self.batch_size:
                    yield pieces
                    pieces, size = [], 0
        if pieces and not self.drop_last:
            yield pieces

    # ---- state -------------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Where the reader stands: the epoch and the number of its batches already yielded."""
        return {
            "epoch": self.epoch, "batch": self._batch, "seed": self.seed, "batch_size": self.batch_size,
            "rank": self.rank, "world_size": self.world_size, "shuffle": self.shuffle,
            "drop_last": self.drop_last, "num_samples": self.store.num_samples,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at exactly the batch after the last one yielded when `state` was taken."""
        for key in ("seed", "batch_size", "rank", "world_size", "shuffle", "drop_last", "num_samples"):
            mine = self.store.num_samples if key == "num_samples" else getattr(self, key)
            if state.get(key) != mine:
                raise StorageError(
                    f"reader of {self.store.path}: cannot resume a state with {key}={state.get(key)!r}, this reader "
                    f"has {key}={mine!r}; build the reader with the same settings"
                )
        self.epoch, self._batch = int(state["epoch"]), int(state["batch"])

    # ---- iteration ---------------------------------------------------------------------------------------------
    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        """Yield the remaining batches of the current epoch; the epoch counter advances after its last batch."""
        epoch, first, total = self.epoch, self._batch, len(self)
        if self.prefetch == 0:
            load = functools.lru_cache(maxsize=2)(self._load_now)  # a batch spans at most two shards in a row
            batches: Iterator = (self._assemble(p, load) for p in self._batches(epoch, first))
        else:
            batches = self._prefetched(epoch, first)
        for number, batch in enumerate(batches, start=first + 1):
            if number >= total:
                self.epoch, self._batch = epoch + 1, 0
            else:
                self._batch = number
            yield batch

    def _load_now(self, shard: int) -> dict[str, torch.Tensor]:
        return self.store.read_shard(shard, self.fields, check=self.check)

    def _assemble(self, pieces: list[tuple[int, np.ndarray]], load) -> dict[str, torch.Tensor]:
        parts = [(load(shard), idx) for shard, idx in pieces]
        batch = {}
        for name in self.fields:
            tensor = self._gather([(data[name], idx) for data, idx in parts])
            batch[name] = tensor
        if self.decode is not None:
            batch = self.store.decode(batch, self.decode)
        return {name: t.pin_memory() for name, t in batch.items()} if self.pin_memory else batch

    def _gather(self, parts: list[tuple[torch.Tensor, np.ndarray]]) -> torch.Tensor:
        """The rows `idx` of each tensor, concatenated into one new tensor (a view for one sequential piece).

        Rows are copied by numpy straight into the batch (one thread, GIL released): torch's index_select and
        cat run on the intra-op thread pool, which fights the decoding threads and the trainer for the cores."""
        if not self.shuffle and len(parts) == 1:  # sequential order: indices are a contiguous range, take a view
            tensor, idx = parts[0]
            return tensor[int(idx[0]) : int(idx[-1]) + 1]
        first = parts[0][0]
        if not all(t.is_contiguous() and t.device.type == "cpu" for t, _ in parts):
            chunks = [t.index_select(0, torch.from_numpy(idx)) for t, idx in parts]
            return chunks[0] if len(chunks) == 1 else torch.cat(chunks)
        out = torch.empty((sum(len(idx) for _, idx in parts), *first.shape[1:]), dtype=first.dtype)
        target, row = to_numpy(out), 0
        for tensor, idx in parts:
            if len(idx) and not 0 <= int(idx.min()) <= int(idx.max()) < len(tensor):
                raise StorageError(f"reader of {self.store.path}: sample index out of range of its shard")
            # mode="clip" (indices checked above): with mode="raise", numpy copies through a temporary buffer.
            np.take(to_numpy(tensor), idx, axis=0, out=target[row : row + len(idx)], mode="clip")
            row += len(idx)
        return out

    def _prefetched(self, epoch: int, first: int) -> Iterator[dict[str, torch.Tensor]]:
        """Batches assembled by a background thread; shards decoded `threads` at a time, ahead of use."""
        out: queue.Queue = queue.Queue(maxsize=self.prefetch)
        stop = threading.Event()

        def put(item: Any) -> bool:
            while not stop.is_set():
                try:
                    out.put(item, timeout=0.1)
                    return True
                except queue.Full:
                    continue
            return False

        def produce() -> None:
            pool = ThreadPoolExecutor(self.threads, thread_name_prefix="storage-reader")
            loading: OrderedDict[int, Future] = OrderedDict()
            upcoming: list[int] = []
            ahead = max(self.threads, 2)

            def load(shard: int) -> dict[str, torch.Tensor]:
                while shard not in loading or (len(loading) < ahead + 1 and upcoming):
                    nxt = upcoming.pop(0)
                    loading[nxt] = pool.submit(self._load_now, nxt)
                    if len(upcoming) > ahead:  # readahead of the files decoded after the ones in flight
                        self.store.will_read(upcoming[ahead])
                return loading[shard].result()

            seen: set[int] = set()
            try:  # the plan too: a failure anywhere in this thread reaches the consumer, which would wait forever
                plan = list(self._batches(epoch, first))
                upcoming.extend(OrderedDict.fromkeys(shard for pieces in plan for shard, _ in pieces))
                for pieces in plan:
                    batch = self._assemble(pieces, load)
                    seen.update(shard for shard, _ in pieces)
                    for shard in [s for s in loading if s in seen and s != pieces[-1][0]]:
                        del loading[shard]  # runs never revisit a shard: it is done
                    if not put(batch):
                        return
                put(_END)
            except BaseException as err:  # handed to the consumer, raised there
                put(_Failure(err))
            finally:
                stop.set()
                pool.shutdown(wait=True, cancel_futures=True)

        thread = threading.Thread(target=produce, name="storage-reader-batches", daemon=True)
        thread.start()
        try:
            while True:
                item = out.get()
                if item is _END:
                    return
                if isinstance(item, _Failure):
                    raise item.error
                yield item
        finally:
            stop.set()
            thread.join()
