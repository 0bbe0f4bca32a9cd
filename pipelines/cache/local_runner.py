"""Running a caching job's shards in this process: the forward on the calling thread, finished shards through a
bounded queue of `QUEUE_DEPTH` to a writer thread, so that compression and fsync overlap the next shard's
forward."""

from __future__ import annotations

import queue
import threading
import time

from preinfer.errors import is_disk_full
from preinfer.staged import StagedModel
from pipelines.cache.options import CacheOptions
from pipelines.progress import Progress
from pipelines.cache.result import CacheJobError
from pipelines.cache.shards import HostStager, compute_shard, host_fields, one_line, write_shard
from pipelines.cache.work import Failure, SplitJob

QUEUE_DEPTH = 2


def run_local(staged: StagedModel, jobs: list[SplitJob], boundary: int, opts: CacheOptions, progress: Progress,
              timing: dict[str, float]) -> tuple[list[Failure], BaseException | None]:
    """Compute and write the shards of `jobs` still to do, adding to `timing`; returns (the shards that failed,
    the error that stopped the job or None)."""
    stager = HostStager(opts.device, max_pooled=QUEUE_DEPTH + 2)
    work: queue.Queue = queue.Queue(maxsize=QUEUE_DEPTH)
    failed: list[Failure] = []
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
                write_shard(job.store, job.name, shard, buffers, opts.retries, opts.before_shard_write)
                timing["write"] += time.perf_counter() - began
                nbytes = job.store.shard_bytes(shard)
                samples = job.shard_done(shard, nbytes)
                progress.advance(samples, tokens=samples * job.seq_len, nbytes=nbytes)
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
            fields = host_fields(job.store, staged.compute_dtype)
            for shard in job.todo:
                if state["fatal"] is not None:
                    break
                lo, hi = job.store.shard_range(shard)
                began = time.perf_counter()
                for attempt in range(opts.retries + 1):
                    try:
                        buffers, fence = compute_shard(staged, job.inputs, job.start_layer, boundary, lo, hi,
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
                            raise CacheJobError("the cache writer thread stopped") from None
                timing["blocked"] += time.perf_counter() - computed
    finally:
        work.put(None)
        thread.join()
        staged.model.train(was_training)
    return failed, state["fatal"]
