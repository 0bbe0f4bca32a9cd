"""Running a caching job's planned shards: `run_shards` computes and writes the shards each split's store still
lacks (a `SplitJob`), either in this process (the forward on the calling thread, finished shards through a bounded
queue of `QUEUE_DEPTH` to a writer thread) or as one Dask task per shard (`pipelines.dask_cache`), under a progress
bar, and returns the shards that failed and any error that stopped the job instead of raising; `pipelines.caching`
plans the jobs, turns failures into a CacheJobError and finalizes the stores."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from preinfer.data import TokenDataset
from preinfer.errors import UsageError
from preinfer.staged import StagedModel
from preinfer.state import BoundaryState
from storage import Fingerprint, Store
from pipelines.shards import HostStager, compute_shard, is_disk_full, shard_bytes, write_shard

QUEUE_DEPTH = 2


# ---- the planned jobs ------------------------------------------------------------------------------------------


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
    bytes_written: int = 0
    stored_bytes: int = 0


@dataclass
class SplitJob:
    """One split's planned work: its store, the inputs of its samples, the shards still to do and its result."""

    name: str
    store: Store
    inputs: Callable[[int, int], BoundaryState]
    result: SplitResult
    todo: list[int]
    source_path: Path | None = None  # roll-forward (Dask tasks read it themselves)
    source_digest: str | None = None
    dataset: TokenDataset | None = None


@dataclass
class Options:
    """The caching job's options, checked (`pipelines.caching` makes them)."""

    fmt: str
    dtype: torch.dtype
    batch_size: int
    samples_per_shard: int | None
    codec: str | None
    mode: str
    model_name: str
    model_seed: int
    progress: bool
    dask: Any
    retries: int
    device: torch.device


# ---- running them ----------------------------------------------------------------------------------------------


def run_shards(staged: StagedModel, jobs: list[SplitJob], boundary: int, opts: Options,
               timing: dict[str, float]) -> tuple[list[tuple[str, int, str]], BaseException | None, dict[str, int]]:
    """Compute and write the shards of `jobs` still to do, in this process or on Dask (`opts.dask`), adding to
    `timing`; returns (failed (split, shard, why), the error that stopped the job or None, model loads per worker)."""
    bar = _Progress(jobs, opts.progress)
    try:
        if opts.dask is not None:
            return _run_dask(staged, jobs, boundary, opts, bar, timing)
        failed, fatal = _run_local(staged, jobs, boundary, opts, bar, timing)
        return failed, fatal, {}
    finally:
        bar.close()


def describe_workers(dask: Any) -> str:
    """What runs the shards: "1" (this process), the `dask` spec, or the address of a Client's scheduler."""
    if dask is None:
        return "1"
    return dask if isinstance(dask, str) else f"dask {getattr(dask, 'scheduler', None) and dask.scheduler.address}"


def one_line(err: BaseException) -> str:
    """An error's message on one line (its type's name if it has none)."""
    text = str(err) or type(err).__name__
    return " ".join(text.split())


# ---- progress -------------------------------------------------------------------------------------------------


class _Progress:
    """A tqdm bar (stderr) over the samples still to compute: samples/s, tokens/s, MB written."""

    def __init__(self, jobs: list[SplitJob], enabled: bool):
        self.total = sum(self._todo_samples(job) for job in jobs)
        self.seq_len = {job.name: job.store.fields["hidden"].shape[0] for job in jobs}
        self.bytes = 0
        self.tokens = 0
        self.started = time.perf_counter()
        self.bar = None
        if enabled:
            from tqdm import tqdm

            self.bar = tqdm(total=self.total, unit="sample", desc="cache", dynamic_ncols=True, leave=False)
        self._lock = threading.Lock()

    @staticmethod
    def _todo_samples(job: SplitJob) -> int:
        return sum(hi - lo for lo, hi in map(job.store.shard_range, job.todo))

    def shard_done(self, split: str, samples: int, nbytes: int) -> None:
        with self._lock:
            self.bytes += nbytes
            self.tokens += samples * self.seq_len[split]
            if self.bar is not None:
                elapsed = max(time.perf_counter() - self.started, 1e-9)
                self.bar.set_postfix_str(f"{self.tokens / elapsed:,.0f} tok/s, {self.bytes / 2**20:,.1f} MB",
                                         refresh=False)
                self.bar.update(samples)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


# ---- single process: forward on this thread, writing on another ------------------------------------------------


def _run_local(staged: StagedModel, jobs: list[SplitJob], boundary: int, opts: Options, bar: _Progress,
               timing: dict[str, float]):
    stager = HostStager(opts.device, max_pooled=QUEUE_DEPTH + 2)
    work: queue.Queue = queue.Queue(maxsize=QUEUE_DEPTH)
    failed: list[tuple[str, int, str]] = []
    state: dict[str, BaseException | None] = {"fatal": None}
    was_training = staged.model.training
    staged.model.eval()

    def writer() -> None:
        while True:
            item = work.get()
            if item is None:
                return
            job, shard, buffers, fence = item
            try:
                if state["fatal"] is not None:
                    continue  # drain: the job is stopping
                fence.synchronize()
                began = time.perf_counter()
                write_shard(job.store, job.name, shard, buffers, opts.retries)
                timing["write"] += time.perf_counter() - began
                lo, hi = job.store.shard_range(shard)
                nbytes = shard_bytes(job.store, shard)
                job.result.shards_computed += 1
                job.result.bytes_written += nbytes
                bar.shard_done(job.name, hi - lo, nbytes)
            except BaseException as err:  # noqa: BLE001 - reported after the queue drains
                if is_disk_full(err) or not isinstance(err, Exception):
                    state["fatal"] = err
                failed.append((job.name, shard, one_line(err)))
            finally:
                stager.release(buffers)

    thread = threading.Thread(target=writer, name="preinfer-cache-writer", daemon=True)
    thread.start()
    try:
        for job in jobs:
            fields = {n: (s.shape, _torch_dtype(s.dtype)) for n, s in job.store.fields.items()}
            for shard in job.todo:
                if state["fatal"] is not None:
                    break
                lo, hi = job.store.shard_range(shard)
                began = time.perf_counter()
                for attempt in range(opts.retries + 1):
                    try:
                        buffers, fence = compute_shard(staged, job.inputs, job.inputs.start_layer, boundary, lo, hi,
                                                       opts.batch_size, fields, stager)
                        break
                    except Exception as err:  # noqa: BLE001 - named in the job's error; the other shards go on
                        if attempt == opts.retries:
                            failed.append((job.name, shard, f"computing it failed: {one_line(err)}"))
                            buffers = None
                if buffers is None:
                    continue
                computed = time.perf_counter()
                timing["forward"] += computed - began
                while True:  # a bounded put that notices a writer that stopped
                    try:
                        work.put((job, shard, buffers, fence), timeout=0.5)
                        break
                    except queue.Full:
                        if not thread.is_alive():
                            raise RuntimeError("the cache writer thread stopped") from None
                timing["blocked"] += time.perf_counter() - computed
    finally:
        work.put(None)
        thread.join()
        staged.model.train(was_training)
    return failed, state["fatal"]


def _torch_dtype(name: str) -> torch.dtype:
    from storage.dtypes import torch_dtype

    return torch_dtype(name)


# ---- Dask ------------------------------------------------------------------------------------------------------


def _run_dask(staged: StagedModel, jobs: list[SplitJob], boundary: int, opts: Options, bar: _Progress,
              timing: dict[str, float]):
    from pipelines import dask_cache

    if not opts.model_name:
        raise UsageError("Dask workers load the model themselves: give its spec (a preset, a directory or a run "
                         "directory) as model_name / --model")
    return dask_cache.run(staged, jobs, boundary, opts, bar, timing)

