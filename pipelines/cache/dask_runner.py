"""The Dask side of the caching job: one task per shard that computes and writes its own shard.

Workers keep the model in a per-process cache keyed by (spec, seed, device), so each worker loads it once, not
once per task; a task checks the cached model's prefix digest against the one the client computed from its
in-memory model and reloads a run directory once if its checkpoint moved on, else fails (the store would lie).
At most `2 x workers` tasks are in flight, so the token tensors a task carries never pile up in the scheduler.
Before the first task, the client registers `worker_imports`' plugin on the cluster.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

import preinfer
from preinfer.errors import UsageError, is_disk_full
from preinfer.fingerprint import prefix_digest
from preinfer.staged import StagedModel
from storage import Store, open_store
from pipelines.cache.options import CacheOptions, LocalWorkers, SchedulerAddress
from pipelines.progress import Progress
from pipelines.cache.result import CacheJobError
from pipelines.cache.shards import (
    DatasetInputs, HostStager, StoreInputs, compute_shard, host_fields, one_line, write_shard,
)
from pipelines.cache.work import Failure, SplitJob
from pipelines.cache.worker_imports import worker_plugin
from pipelines.data.token_store import TokenStoreDataset
from pipelines.models import is_run_dir, resolve_model

_LOCK = threading.Lock()
_MODELS: dict[tuple, StagedModel] = {}
_DIGESTS: dict[tuple, dict[int, str]] = {}
_STATS = {"loads": 0, "threads_set": False}


@dataclass
class ShardTask:
    """Everything one task needs, picklable and small: the shard's inputs travel as the token store's path (the
    worker reads the samples it needs itself), or, for samples held in memory, as their token tensors."""

    split: str
    store_path: str
    store_digest: str
    shard: int
    lo: int
    hi: int
    boundary: int
    start_layer: int
    batch_size: int
    model_spec: str
    model_seed: int
    model_attention: str  # the client's attention implementation: the workers' states must equal its own
    device: str
    prefix: str  # prefix digest at `boundary` of the client's model
    inputs: TokenStoreDataset | dict[str, torch.Tensor] | None = None  # the input's split, or tokens of [lo, hi)
    source_path: str | None = None  # or the store at `start_layer` to roll forward from
    source_digest: str | None = None
    torch_threads: int | None = None
    before_write: Callable[[str, int], None] | None = None


def _current_worker() -> Any:
    """The Dask worker running this task, or None outside a worker."""
    try:
        from distributed import get_worker

        return get_worker()
    except (ImportError, ValueError):
        return None


def _worker_name() -> str:
    worker = _current_worker()
    return worker.address if worker is not None else f"pid {os.getpid()}"


def worker_device(device: str, worker_name: Any, gpus: int) -> str:
    """The device a worker computes on: with a bare "cuda", worker i of a LocalCluster (named i) takes GPU
    i mod `gpus`, round-robin over the visible ones; an explicit index, the CPU and workers named otherwise (those
    of a remote cluster, placed by their own CUDA_VISIBLE_DEVICES) keep `device`."""
    if device != "cuda" or gpus < 1 or isinstance(worker_name, bool) or not isinstance(worker_name, int):
        return device
    return f"cuda:{worker_name % gpus}"


def worker_model(spec: str, seed: int, attention: str, device: str, boundary: int, expected: str) -> StagedModel:
    """The staged model of `spec` (running `attention`) in this worker process, loaded once, whose prefix at
    `boundary` is `expected`."""
    key = (spec, seed, attention, device)
    with _LOCK:
        for attempt in range(2):
            if key not in _MODELS:
                model = resolve_model(spec, seed, attention).to(device).eval()
                _MODELS[key] = preinfer.stage(model)
                _DIGESTS[key] = {}
                _STATS["loads"] += 1
            staged = _MODELS[key]
            digests = _DIGESTS[key]
            if boundary not in digests:
                digests[boundary] = prefix_digest(staged, boundary)
            if digests[boundary] == expected:
                return staged
            if attempt == 0 and is_run_dir(spec):
                del _MODELS[key]  # the run's checkpoint moved on since this worker loaded it
                continue
            break
    raise CacheJobError(
        f"worker {_worker_name()}: the model loaded from {spec!r} has another prefix [0, {boundary}) than the "
        f"client's (digest {digests[boundary][:12]} != {expected[:12]}); workers must load the same weights "
        f"(save them to a directory or checkpoint the run first)"
    )


def _store(path: str, digest: str) -> Store:
    """The store at `path`, opened afresh by every task: a cached Store would keep the completion records of a
    store since deleted and recreated at the same path (an overwrite), and skip its writes."""
    return open_store(path, expect_fingerprint=digest, check_files=False)


def _tune_malloc() -> None:
    """Undo the cost of Dask's default MALLOC_TRIM_THRESHOLD_=65536 for tensor work (measured: the prefix forward
    of small-llama at half speed): a fixed trim threshold also freezes glibc's mmap threshold at 128 KiB, so every
    activation buffer is mmapped, page-faulted and unmapped again. Raise both (glibc only; elsewhere a no-op)."""
    if not os.environ.get("MALLOC_TRIM_THRESHOLD_") or not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, 32 << 20)  # M_MMAP_THRESHOLD: glibc's maximum
        libc.mallopt(-1, 256 << 20)  # M_TRIM_THRESHOLD
    except (OSError, AttributeError):
        pass


def run_task(task: ShardTask) -> dict[str, Any]:
    """Compute shard `task.shard` and write it; returns what the client counts."""
    if not _STATS["threads_set"]:
        if task.torch_threads:
            torch.set_num_threads(task.torch_threads)
        _tune_malloc()
        _STATS["threads_set"] = True
    gpus = torch.cuda.device_count() if task.device == "cuda" else 0
    device = worker_device(task.device, getattr(_current_worker(), "name", None), gpus)
    staged = worker_model(task.model_spec, task.model_seed, task.model_attention, device, task.boundary,
                          task.prefix)
    store = _store(task.store_path, task.store_digest)
    if task.inputs is not None:
        inputs = DatasetInputs(staged, task.inputs, device, offset=task.lo)
    else:
        inputs = StoreInputs(_store(task.source_path, task.source_digest), task.start_layer, device,
                             staged.compute_dtype)
    stager = HostStager(device)
    started = time.perf_counter()
    buffers, fence = compute_shard(staged, inputs, task.start_layer, task.boundary, task.lo, task.hi,
                                   task.batch_size, host_fields(store, staged.compute_dtype), stager)
    fence.synchronize()
    computed = time.perf_counter()
    write_shard(store, task.split, task.shard, buffers, before_write=task.before_write)
    return {"split": task.split, "shard": task.shard, "bytes": store.shard_bytes(task.shard),
            "worker": _worker_name(), "loads": _STATS["loads"], "compute_s": computed - started,
            "write_s": time.perf_counter() - computed, "torch_threads": torch.get_num_threads(), "device": device}


# "local:N" clusters of this process, kept for the next job (a BCD run caches after every visit): started once,
# their workers keep the model loaded; closed at exit or by shutdown_local_clusters().
_LOCAL_CLUSTERS: dict[int, tuple[Any, Any]] = {}


def shutdown_local_clusters() -> None:
    """Close the LocalClusters that `local:N` jobs of this process started."""
    while _LOCAL_CLUSTERS:
        _, (cluster, client) = _LOCAL_CLUSTERS.popitem()
        try:
            client.close()
            cluster.close()
        except Exception:  # noqa: BLE001 - closing at exit; nothing left to report to
            pass


def local_client(workers: int):
    """The client of this process's LocalCluster of `workers` worker processes (started on first use)."""
    from distributed import Client, LocalCluster

    cached = _LOCAL_CLUSTERS.get(workers)
    if cached is not None and cached[1].status == "running":
        return cached[1]
    if not _LOCAL_CLUSTERS:
        atexit.register(shutdown_local_clusters)
    import dask

    # Dask's default MALLOC_TRIM_THRESHOLD_ halves PyTorch's CPU speed (see _tune_malloc): leave it unset.
    with dask.config.set({"distributed.nanny.pre-spawn-environ.MALLOC_TRIM_THRESHOLD_": None}):
        cluster = LocalCluster(n_workers=workers, threads_per_worker=1, processes=True, dashboard_address=None,
                               silence_logs=logging.ERROR)
    client = Client(cluster)
    _LOCAL_CLUSTERS[workers] = (cluster, client)
    return client


CONNECT_TIMEOUT = "20s"  # how long a client tries to reach a scheduler


def scheduler_client(dask: SchedulerAddress) -> Any:
    """A client of the scheduler at `dask`; one that cannot be reached is one line naming --dask."""
    from distributed import Client

    try:
        return Client(dask.address, timeout=CONNECT_TIMEOUT)
    except (OSError, TimeoutError) as err:
        raise UsageError(f"--dask {dask}: cannot reach the Dask scheduler ({err}); start it, or give the address "
                         f"it listens on, then run the same command again") from None


def check_reachable(dask: Any) -> None:
    """Refuse a scheduler address that cannot be reached, before a job makes its stores (a local cluster or a
    client of one starts, or is, reachable)."""
    if isinstance(dask, SchedulerAddress):
        scheduler_client(dask).close()


def connect(dask: Any) -> tuple[Any, Callable[[], None], int | None]:
    """(client, close, torch threads per worker) for a `LocalWorkers`, a `SchedulerAddress` or a
    `distributed.Client`, with the import plugin registered."""
    if isinstance(dask, LocalWorkers):
        client, close, threads = local_client(dask.workers), lambda: None, dask.torch_threads
    elif isinstance(dask, SchedulerAddress):
        client = scheduler_client(dask)
        close, threads = client.close, None
    else:
        client, close, threads = dask, lambda: None, None
    client.register_plugin(worker_plugin())  # idempotent: registered once per cluster
    return client, close, threads


POLL_S = 5.0  # how often a job whose tasks are all still running looks at the cluster's workers
NO_WORKERS_TIMEOUT_S = 120.0  # a cluster without a single worker for this long fails the job (its workers are lost)


class _Workerless:
    """Notices a cluster that has lost every worker, where Dask itself would wait for new ones forever."""

    def __init__(self, client: Any):
        self.client = client
        self.since: float | None = None

    def check(self, cluster: str) -> BaseException | None:
        """None while the cluster has workers or has had none for less than NO_WORKERS_TIMEOUT_S; else the error."""
        if self.client.scheduler_info().get("workers"):
            self.since = None
            return None
        now = time.monotonic()
        self.since = self.since or now
        if now - self.since < NO_WORKERS_TIMEOUT_S:
            return None
        return CacheJobError(f"the Dask cluster ({cluster}) has had no workers for {now - self.since:.0f} s: its "
                             f"workers were lost or never started")


def run(staged: StagedModel, jobs: list[SplitJob], boundary: int, opts: CacheOptions, progress: Progress,
        timing: dict[str, float]) -> tuple[list[Failure], BaseException | None, dict[str, int]]:
    """Run the shards of `jobs` as Dask tasks, adding to `timing`; returns (the shards that failed, the error that
    stopped the job or None, model loads per worker)."""
    from distributed import wait

    if not opts.model_name:
        raise UsageError("Dask workers load the model themselves: give its spec (a preset, a directory or a run "
                         "directory) as model_name / --model")
    logging.getLogger("distributed").setLevel(logging.ERROR)
    client, close, threads = connect(opts.dask)
    failed: list[Failure] = []
    fatal: BaseException | None = None
    loads: dict[str, int] = {}
    try:
        prefix = prefix_digest(staged, boundary)
        pending = [(job, shard) for job in jobs for shard in job.todo]
        window = max(4, 2 * len(client.scheduler_info().get("workers", {}) or [None]))
        run_id = uuid.uuid4().hex[:8]
        owners: dict[Any, tuple[Any, int]] = {}

        def submit(job: SplitJob, shard: int):
            lo, hi = job.store.shard_range(shard)
            inputs = job.dataset
            if job.dataset is not None and not isinstance(job.dataset, TokenStoreDataset):
                inputs = {k: v.clone() for k, v in job.dataset[lo:hi].items()}  # in-memory samples travel
            task = ShardTask(
                job.name, str(job.store.path), job.store.fingerprint.digest, shard, lo, hi, boundary,
                job.start_layer, opts.batch_size, opts.model_name, opts.model_seed, staged.attention,
                str(opts.device), prefix,
                inputs, None if job.source_path is None else str(job.source_path), job.source_digest, threads,
                opts.before_shard_write,
            )
            future = client.submit(run_task, task, key=f"preinfer-cache-{job.name or 'store'}-{shard}-{run_id}",
                                   retries=opts.retries, pure=False)
            owners[future] = (job, shard)
            return future

        queue = iter(pending)
        in_flight = {submit(*item) for _, item in zip(range(window), queue)}
        workerless = _Workerless(client)
        while in_flight and fatal is None:
            try:
                done, in_flight = wait(in_flight, timeout=POLL_S, return_when="FIRST_COMPLETED")
            except TimeoutError:
                fatal = workerless.check(opts.workers)
                continue
            for future in done:
                job, shard = owners.pop(future)
                if future.status == "error":
                    err = future.exception()
                    failed.append((job.name, shard, one_line(err)))
                    if is_disk_full(err):
                        fatal = err
                        break
                else:
                    result = future.result()
                    timing["forward"] += result["compute_s"]
                    timing["write"] += result["write_s"]
                    loads[result["worker"]] = result["loads"]
                    samples = job.shard_done(shard, result["bytes"])
                    progress.advance(samples, tokens=samples * job.seq_len, nbytes=result["bytes"])
                following = next(queue, None)
                if following is not None:
                    in_flight.add(submit(*following))
        if fatal is not None:
            client.cancel(list(owners))
    finally:
        close()
    return failed, fatal, loads
