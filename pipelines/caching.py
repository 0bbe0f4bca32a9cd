"""The pre-inference caching job: run the frozen prefix once over a dataset and store the boundary states.

Python API (what `preinfer cache` and `bcd --pre-inference` call; the model is already in memory)::

    cache_boundary(staged, datasets, tokenizer, boundary, out, *, fmt="zarr", dtype="auto", batch_size=16,
                   samples_per_shard=None, codec=None, mode="resume", model_name="", model_seed=0,
                   progress=True, dask=None, retries=2, device=None) -> CacheResult
        Embedding + layers [0, boundary) over every sample of each split in `datasets` ({"train": ds, ...}),
        written to the cache directory `out`: one complete `storage` store per split, `out/<split>/`, plus
        `out/cache.json` (an index written last, once every split is finalized).
    roll_forward(staged, source, boundary, out, *, <same options>) -> CacheResult
        Only layers [K, boundary) over the store(s) at boundary K in `source` (a cache directory, or a single
        store, then `out` is a single store too). The source must match `staged`'s current prefix [0, K) and
        hold the compute dtype (lossless); the result, store and fingerprint, equals a fresh cache_boundary at
        `boundary` with the same weights, batch size and shard size.
    cache_fingerprint(staged, dataset, tokenizer, boundary, dtype, model_name="") -> storage.Fingerprint
        The fingerprint a store of `dataset`'s boundary states at `boundary` gets (`dtype`: the storage dtype,
        "auto" meaning the compute dtype).
    open_cache(path, splits=None) -> dict[str, storage.Store]
        The stores of a cache directory (or {"": store} for a single store).

What is stored, per sample i of a split's `TokenDataset` (store sample i = dataset sample i, dataset order):
`hidden` [T, H] in the storage dtype, `attention_mask` [T] bool, `position_ids` [T] int64, `labels` [T] int64,
i.e. `BoundaryState.to_dict()` of one sample. `dtype="auto"` stores the compute dtype bit for bit; a lower dtype
(`bfloat16`, `float16`) is an explicit choice recorded in the fingerprint.

Batches never straddle shards: shard i covers samples [i*S, (i+1)*S) and is computed in batches of
`batch_size` from its first sample, so every way of running the job (resumed, rolled forward, on Dask) runs
the same forward batches and writes identical bytes. The default shard size aims at 64 MiB of hidden states
(`SHARD_TARGET_BYTES`), at least one sample.

`mode`: "resume" (default) reuses a store with the same fingerprint and computes only its missing shards (a
complete one is a no-op) and refuses a store with another fingerprint (StaleStoreError naming the differing
parts); "overwrite" deletes what is there and rebuilds; "refuse" fails if anything is at `out` already.

Single process: the forward runs on the calling thread; finished shards go through a bounded queue
(`cache_runners.QUEUE_DEPTH`) to a writer thread, so compression and fsync overlap the next shard's forward. Host
copies go into pooled buffers (`HostStager`); on CUDA these are pinned, filled by non_blocking device-to-host copies,
and the writer waits on an event recorded after the last copy before it touches them.

Dask (`dask="local:N"`, `"tcp://host:port"` or a `distributed.Client`): one task per shard, each computing and
writing its own shard, retried `retries` times. Workers load the model themselves from `model_name` (a preset,
a save_pretrained directory or a BCD run directory, with `model_seed` for presets) once per worker, and check
that its prefix digest equals the one the client expects (a run directory whose checkpoint moved on is
reloaded once; otherwise the task fails). `local:N` starts N worker processes with one Dask thread each and
`max(1, cores // N)` torch threads; the cluster stays up for the next `local:N` job of the same process (so a
BCD run that caches after every visit starts it, and loads the model in it, once) until exit or
`pipelines.dask_cache.shutdown_local_clusters()`. Remote workers need this package installed and the store path
(and a roll-forward's source) on a shared filesystem.

This module plans the job (checks, fingerprints, stores, the shards still to do), then finalizes the stores and
writes the index; running the planned shards, here or on Dask, is in `pipelines.cache_runners`, and the work on
one shard (staging, inputs, forward, writing) in `pipelines.shards`, shared with the Dask workers. The test
hooks are environment variables read where shards are written, Dask workers included:
PREINFER_CACHE_FAULTS = "train/3,eval/0" makes those shards fail when written; with
PREINFER_CACHE_FAULT_ONCE_DIR set each fails only once (a marker file there records it);
PREINFER_CACHE_SHARD_DELAY = seconds slept before each shard is written.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from preinfer.data import TokenDataset
from preinfer.errors import PreinferError, UsageError
from preinfer.fingerprint import boundary_fingerprint, prefix_digest
from preinfer.staged import StagedModel
from storage import Fingerprint, StaleStoreError, Store, StorageError, create_store, open_store
from storage.codecs import codec_spec
from storage.manifest import parse_manifest
from storage.store import MANIFEST
from pipelines.cache_runners import Options, SplitJob, SplitResult, describe_workers, one_line, run_shards
from pipelines.shards import DatasetInputs, StoreInputs, is_disk_full

SHARD_TARGET_BYTES = 64 << 20
CACHE_INDEX = "cache.json"
CACHE_FORMAT = "preinfer-cache"
DEFAULT_SPLITS = ("train", "eval")
STORE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
MODES = ("resume", "overwrite", "refuse")
FORMATS = ("zarr", "safetensors")


class CacheJobError(PreinferError):
    """Shards failed at run time; every shard finished before stays intact, and rerunning resumes the job."""

    def __init__(self, message: str, failed: list[tuple[str, int]] | None = None):
        super().__init__(message)
        self.failed = failed or []


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
    dtype: str = ""
    fmt: str = ""
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
            f"{self.bytes_written / 2**20:.1f} MiB written ({self.fmt}, {self.dtype}) in {self.seconds:.1f} s, "
            f"{self.tokens_per_s:,.0f} tokens/s"
        )


# ---- fingerprints, dtypes, layout ----------------------------------------------------------------------------


def storage_dtype(staged: StagedModel, dtype: str | torch.dtype) -> torch.dtype:
    """The dtype hidden states are stored in: `auto` is the compute dtype."""
    if dtype in (None, "auto"):
        return staged.compute_dtype
    if isinstance(dtype, torch.dtype):
        if dtype in STORE_DTYPES.values():
            return dtype
    elif dtype in STORE_DTYPES:
        return STORE_DTYPES[dtype]
    raise UsageError(f"--dtype {dtype!r} is not one of auto, {', '.join(STORE_DTYPES)}")


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def check_boundary(staged: StagedModel, boundary: int, above: int = 0) -> None:
    if not isinstance(boundary, int) or not max(1, above + 1) <= boundary <= staged.num_layers:
        low = max(1, above + 1)
        why = f" (above the source store's boundary {above})" if above else ""
        raise UsageError(
            f"--boundary {boundary} is outside [{low}, {staged.num_layers}]{why}: the model has "
            f"{staged.num_layers} layers and boundary k stores the input of layer k"
        )


def _fingerprint(prefix: str, boundary: int, dataset: str, tokenizer: str, seq_len: int, dtype: str,
                 model_name: str) -> Fingerprint:
    digest, parts = boundary_fingerprint(prefix, boundary, dataset, tokenizer, seq_len, dtype, model=model_name)
    return Fingerprint(digest, parts)


def cache_fingerprint(staged: StagedModel, dataset: TokenDataset, tokenizer: Any, boundary: int,
                      dtype: str | torch.dtype = "auto", model_name: str = "") -> Fingerprint:
    """The fingerprint of `dataset`'s boundary states at `boundary` stored in `dtype`."""
    return _fingerprint(prefix_digest(staged, boundary), boundary, dataset.fingerprint(), tokenizer.fingerprint(),
                        dataset.seq_len, dtype_name(storage_dtype(staged, dtype)), model_name)


def default_samples_per_shard(seq_len: int, hidden_size: int, dtype: torch.dtype,
                              target: int = SHARD_TARGET_BYTES) -> int:
    """Samples per shard so that a shard holds about `target` bytes of hidden states (at least 1)."""
    sample_bytes = seq_len * hidden_size * torch.empty((), dtype=dtype).element_size()
    return max(1, target // sample_bytes)


def store_fields(seq_len: int, hidden_size: int, dtype: torch.dtype) -> dict[str, tuple[tuple[int, ...], Any]]:
    return {
        "hidden": ((seq_len, hidden_size), dtype),
        "attention_mask": ((seq_len,), torch.bool),
        "position_ids": ((seq_len,), torch.int64),
        "labels": ((seq_len,), torch.int64),
    }


def is_store(path: Path) -> bool:
    return (Path(path) / MANIFEST).is_file()


def cache_splits(path: str | os.PathLike) -> dict[str, Path]:
    """{split: store path} of a cache directory, or {"": path} for a single store; {} if neither."""
    path = Path(path)
    if is_store(path):
        return {"": path}
    if not path.is_dir():
        return {}
    names = sorted((p.name for p in path.iterdir() if is_store(p)),
                   key=lambda n: (DEFAULT_SPLITS.index(n) if n in DEFAULT_SPLITS else len(DEFAULT_SPLITS), n))
    return {name: path / name for name in names}


def open_cache(path: str | os.PathLike, splits: list[str] | None = None,
               expect: Mapping[str, Fingerprint] | None = None) -> dict[str, Store]:
    """The stores of a cache directory (or {"": store} for a single store), checked against `expect`."""
    found = cache_splits(path)
    if not found:
        raise StorageError(f"no activation store or cache directory at {path}")
    if splits is not None:
        missing = [s for s in splits if s not in found]
        if missing and "" not in found:
            raise StorageError(f"cache {path} has no split {', '.join(missing)} (it has {', '.join(found)})")
        found = found if "" in found else {s: found[s] for s in splits}
    return {name: open_store(p, expect_fingerprint=(expect or {}).get(name)) for name, p in found.items()}


# ---- the job --------------------------------------------------------------------------------------------------


def _options(
    staged: StagedModel,
    *,
    fmt: str = "zarr",
    dtype: str | torch.dtype = "auto",
    batch_size: int = 16,
    samples_per_shard: int | None = None,
    codec: str | None = None,
    mode: str = "resume",
    model_name: str = "",
    model_seed: int = 0,
    progress: bool = True,
    dask: Any = None,
    retries: int = 2,
    device: torch.device | str | None = None,
) -> Options:
    """The job's options, checked: every one a user can get wrong gets a one-line UsageError."""
    if fmt not in FORMATS:
        raise UsageError(f"--format {fmt!r} is not one of {', '.join(FORMATS)}")
    if mode not in MODES:
        raise UsageError(f"mode {mode!r} is not one of {', '.join(MODES)}")
    if not isinstance(batch_size, int) or batch_size < 1:
        raise UsageError(f"--batch-size must be a positive integer, got {batch_size!r}")
    if samples_per_shard is not None and (not isinstance(samples_per_shard, int) or samples_per_shard < 1):
        raise UsageError(f"--samples-per-shard must be a positive integer, got {samples_per_shard!r}")
    if not isinstance(retries, int) or retries < 0:
        raise UsageError(f"--retries must be an integer >= 0, got {retries!r}")
    try:
        codec_spec(fmt, codec, None)
    except StorageError as err:
        raise UsageError(f"--codec: {err}") from None
    check_dask(dask)
    if device is None:
        device = next(iter(staged.model.parameters())).device
    return Options(fmt, storage_dtype(staged, dtype), batch_size, samples_per_shard, codec, mode, model_name,
                    model_seed, progress, dask, retries, torch.device(device))


def check_dask(dask: Any) -> None:
    """Refuse a malformed `dask` before anything is created: None, "local:N", "tcp://..." or a Client."""
    if dask is None or not isinstance(dask, str):
        return
    if dask.startswith("local:"):
        count = dask.removeprefix("local:")
        if not count.isdigit() or int(count) < 1:
            raise UsageError(f"--dask {dask!r}: expected local:N with N >= 1 workers")
    elif "://" not in dask:
        raise UsageError(f"--dask {dask!r}: expected local:N or a scheduler address such as tcp://host:8786")


def _check_out(out: Path, names: list[str], mode: str) -> None:
    """Refuse an `--out` that is a file, or a directory holding something other than this cache."""
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {out} is a file, not a directory")
    if not out.is_dir():
        return
    if names == [""]:
        return  # a single store: create_store refuses a foreign directory itself
    foreign = sorted(p.name for p in out.iterdir() if not p.name.startswith(".") and not _is_ours(p, names))
    if foreign:
        raise UsageError(
            f"--out {out} is not a cache directory (it holds {foreign[0]!r}{' ...' if len(foreign) > 1 else ''}); "
            f"choose an empty or new directory, nothing was deleted"
        )
    if mode == "refuse" and any((out / n).exists() for n in names):
        raise UsageError(f"--out {out} already holds a cache; choose another directory or rebuild it")


# What a store directory holds (storage's own entries): a split directory with only these is ours, even one a
# killed job left before its manifest was written.
_STORE_ENTRIES = {MANIFEST, "data", "shards", "done", "locks", "shards.safetensors.index.json"}


def _is_ours(entry: Path, names: list[str]) -> bool:
    if entry.name == CACHE_INDEX:
        return entry.is_file()
    if entry.name not in set(names) | set(DEFAULT_SPLITS) or not entry.is_dir():
        return False
    return all(p.name in _STORE_ENTRIES or p.name.startswith(".") for p in entry.iterdir())


def _prepare_store(path: Path, split: str, fields, num_samples: int, per_shard: int, fingerprint: Fingerprint,
                   opts: Options) -> Store:
    """Create the store of one split, or reopen the one there to resume it (refusing another fingerprint)."""
    where = f"{split} store {path}" if split else f"store {path}"
    if path.exists() and not path.is_dir():
        raise UsageError(f"--out {path} is a file, not a directory")
    if opts.mode == "overwrite":
        if path.is_dir() and not all(p.name in _STORE_ENTRIES or p.name.startswith(".") for p in path.iterdir()):
            raise UsageError(f"{path} is not an activation store; not deleting it (choose another --out)")
        return create_store(path, fields, num_samples, per_shard, fingerprint, backend=opts.fmt, codec=opts.codec,
                            overwrite=True)
    if is_store(path):
        manifest = parse_manifest((path / MANIFEST).read_bytes(), str(path / MANIFEST))
        stored = Fingerprint.coerce(manifest["fingerprint"])
        if stored.digest != fingerprint.digest:
            raise StaleStoreError(
                f"{where} was built for another fingerprint ({'; '.join(stored.differences(fingerprint))}); "
                f"pass --overwrite to rebuild it, or choose another --out"
            )
        wanted = {"backend": opts.fmt, "codec": codec_spec(opts.fmt, opts.codec, None), "samples_per_shard": per_shard}
        differs = [f"{k} {manifest[k]!r} (now {v!r})" for k, v in wanted.items() if manifest[k] != v]
        if differs:
            raise UsageError(
                f"{where} has the same fingerprint but another layout: {', '.join(differs)}; resume it with the "
                f"options it was made with, or pass --overwrite to rebuild it"
            )
    return create_store(path, fields, num_samples, per_shard, fingerprint, backend=opts.fmt, codec=opts.codec)


def _plan_split(name: str, path: Path, fields, num_samples: int, tokens: int, fingerprint: Fingerprint,
                opts: Options, inputs, **extra) -> SplitJob:
    per_shard = opts.samples_per_shard or default_samples_per_shard(fields["hidden"][0][0], fields["hidden"][0][1],
                                                                    opts.dtype)
    store = _prepare_store(path, name, fields, num_samples, per_shard, fingerprint, opts)
    todo = store.missing_shards()
    result = SplitResult(name, path, fingerprint, num_samples, tokens, store.num_shards,
                         shards_skipped=store.num_shards - len(todo))
    return SplitJob(name, store, inputs, result, todo, **extra)


def cache_boundary(
    staged: StagedModel,
    datasets: Mapping[str, TokenDataset],
    tokenizer: Any,
    boundary: int,
    out: str | os.PathLike,
    **options: Any,
) -> CacheResult:
    """Store the boundary states at `boundary` of every sample of each split in `datasets` under `out/<split>/`
    (`options`: those of `_options`)."""
    started = time.perf_counter()
    check_boundary(staged, boundary)
    opts = _options(staged, **options)
    if not datasets:
        raise UsageError("no splits to cache")
    out = Path(out)
    _check_out(out, list(datasets), opts.mode)
    prefix = prefix_digest(staged, boundary)
    token_fp = tokenizer.fingerprint()
    jobs = []
    for name, dataset in datasets.items():
        fp = _fingerprint(prefix, boundary, dataset.fingerprint(), token_fp, dataset.seq_len, dtype_name(opts.dtype),
                          opts.model_name)
        fields = store_fields(dataset.seq_len, staged.hidden_size, opts.dtype)
        jobs.append(_plan_split(name, out / name, fields, len(dataset), dataset.num_tokens, fp, opts,
                                DatasetInputs(staged, dataset, opts.device), dataset=dataset))
    return _run_jobs(staged, jobs, out, boundary, 0, opts, started)


def roll_forward(
    staged: StagedModel,
    source: str | os.PathLike,
    boundary: int,
    out: str | os.PathLike,
    *,
    splits: list[str] | None = None,
    **options: Any,
) -> CacheResult:
    """The stores at `boundary` made from the stores at boundary K in `source` by running only layers [K, boundary)
    (`options`: those of `_options`)."""
    started = time.perf_counter()
    opts = _options(staged, **options)
    source, out = Path(source), Path(out)
    found = cache_splits(source)
    if not found:
        raise UsageError(f"--from-store {source}: no activation store or cache directory there")
    if splits is not None and "" not in found:
        missing = [s for s in splits if s not in found]
        if missing:
            raise UsageError(f"--from-store {source} has no split {', '.join(missing)} (it has {', '.join(found)})")
        found = {s: found[s] for s in splits}
    if source.resolve() == out.resolve() or any(p.resolve() == out.resolve() for p in found.values()):
        raise UsageError("--out must differ from --from-store (a roll-forward writes a new store)")
    compute = staged.compute_dtype
    jobs = []
    source_boundary = None
    _check_out(out, list(found), opts.mode)
    prefixes: dict[int, str] = {}
    for name, path in found.items():
        src = open_store(path)
        parts = src.fingerprint.parts
        try:
            k, data_fp, token_fp, seq_len, src_dtype = (int(parts["boundary"]), parts["dataset"], parts["tokenizer"],
                                                        int(parts["seq_len"]), parts["dtype"])
        except (KeyError, TypeError, ValueError):
            raise UsageError(f"--from-store {path}: not a boundary-state store (its fingerprint has no boundary, "
                             f"dataset, tokenizer, seq_len and dtype parts)") from None
        if source_boundary is not None and k != source_boundary:
            raise UsageError(f"--from-store {source}: its splits are at different boundaries ({source_boundary}, {k})")
        source_boundary = k
        check_boundary(staged, boundary, above=k)
        if src_dtype != dtype_name(compute):
            raise UsageError(
                f"--from-store {path} holds {src_dtype} hidden states but the model computes in "
                f"{dtype_name(compute)}: rolling forward from a lossy store would not equal a fresh run; cache "
                f"boundary {boundary} from the input instead"
            )
        if k not in prefixes:
            prefixes[k] = prefix_digest(staged, k)
        expected = _fingerprint(prefixes[k], k, data_fp, token_fp, seq_len, src_dtype, str(parts.get("model", "")))
        if expected.digest != src.fingerprint.digest:
            raise StaleStoreError(
                f"--from-store {path} does not match the model's current prefix [0, {k}) "
                f"({'; '.join(src.fingerprint.differences(expected)) or 'digest differs'}); it cannot be rolled "
                f"forward, cache boundary {boundary} from the input instead"
            )
        src.require_complete()
        if boundary not in prefixes:
            prefixes[boundary] = prefix_digest(staged, boundary)
        fp = _fingerprint(prefixes[boundary], boundary, data_fp, token_fp, seq_len, dtype_name(opts.dtype),
                          opts.model_name)
        fields = store_fields(seq_len, staged.hidden_size, opts.dtype)
        target = out if name == "" else out / name
        tokens = _stored_tokens(src, source, name)
        jobs.append(_plan_split(name, target, fields, src.num_samples, tokens, fp, opts,
                                StoreInputs(src, k, opts.device, compute), source_path=path,
                                source_digest=src.fingerprint.digest))
    return _run_jobs(staged, jobs, out, boundary, source_boundary, opts, started)


def _stored_tokens(store: Store, source: Path, split: str) -> int:
    """Real tokens of a store: from its cache index when the index describes this very store, else counted."""
    try:
        entry = json.loads((source / CACHE_INDEX).read_text())["splits"][split]
        if entry["fingerprint"] == store.fingerprint.digest:
            return int(entry["tokens"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    return sum(int(store.read_shard(i, ["attention_mask"])["attention_mask"].sum()) for i in range(store.num_shards))


def _run_jobs(staged: StagedModel, jobs: list[SplitJob], out: Path, boundary: int, source_boundary: int,
              opts: Options, started: float) -> CacheResult:
    single = len(jobs) == 1 and jobs[0].name == ""
    index = out / CACHE_INDEX
    if not single and any(job.todo for job in jobs) and index.exists():
        index.unlink()  # the index describes only finished caches
    model_loads: dict[str, int] = {}
    timing = {"forward": 0.0, "write": 0.0, "blocked": 0.0}
    failed: list[tuple[str, int, str]] = []
    fatal: BaseException | None = None
    if any(job.todo for job in jobs):
        failed, fatal, model_loads = run_shards(staged, jobs, boundary, opts, timing)
    if fatal is not None or failed:
        _raise_failure(jobs, failed, fatal)
    try:
        for job in jobs:
            job.store.finalize()  # folds completion records into the manifest; a no-op rewrite when complete
            job.result.stored_bytes = job.store.size_info()["stored_bytes"]
    except OSError as err:
        _raise_failure(jobs, [], err)
    result = CacheResult(
        path=out, boundary=boundary, splits={job.name: job.result for job in jobs},
        samples=sum(j.result.samples for j in jobs), tokens=sum(j.result.tokens for j in jobs),
        bytes_written=sum(j.result.bytes_written for j in jobs), seconds=time.perf_counter() - started,
        shards_computed=sum(j.result.shards_computed for j in jobs),
        shards_skipped=sum(j.result.shards_skipped for j in jobs), source_boundary=source_boundary,
        dtype=dtype_name(opts.dtype), fmt=opts.fmt, workers=describe_workers(opts.dask), model_loads=model_loads,
        forward_seconds=timing["forward"], write_seconds=timing["write"], blocked_seconds=timing["blocked"],
    )
    if not single:
        try:
            _write_index(index, result)
        except OSError as err:
            _raise_failure(jobs, [], err)
    return result


def _write_index(index: Path, result: CacheResult) -> None:
    payload = {
        "format": CACHE_FORMAT, "version": 1, "boundary": result.boundary, "dtype": result.dtype,
        "backend": result.fmt, "complete": True,
        "splits": {name: {"path": name, "fingerprint": s.fingerprint.digest, "samples": s.samples,
                          "tokens": s.tokens, "shards": s.num_shards, "stored_bytes": s.stored_bytes}
                   for name, s in result.splits.items()},
    }
    tmp = index.with_name(f".{index.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(payload, indent=1))
    os.replace(tmp, index)


def _raise_failure(jobs: list[SplitJob], failed: list[tuple[str, int, str]], fatal: BaseException | None) -> None:
    done = sum(len(job.store.completed_shards()) for job in jobs)
    total = sum(job.store.num_shards for job in jobs)
    intact = f"{done} of {total} shards are finished and intact; rerun the same command to resume"
    by_name = {job.name: job for job in jobs}
    if fatal is not None:
        if is_disk_full(fatal):
            raise CacheJobError(f"disk full while writing the cache in {jobs[0].store.path}: {one_line(fatal)}. "
                                f"Free space, then {intact[0].lower()}{intact[1:]}",
                                [(s, i) for s, i, _ in failed]) from None
        raise CacheJobError(f"{one_line(fatal)}. {intact}", [(s, i) for s, i, _ in failed]) from None
    names = []
    for split, shard, _ in failed:
        lo, hi = by_name[split].store.shard_range(shard)
        names.append(f"{split + ' ' if split else ''}shard {shard} (samples {lo}..{hi})")
    first = failed[0][2]
    raise CacheJobError(
        f"{len(failed)} shard{'s' if len(failed) > 1 else ''} failed: {', '.join(names[:10])}"
        f"{' ...' if len(names) > 10 else ''} ({first}); {intact}", [(s, i) for s, i, _ in failed])


def remove_cache(path: str | os.PathLike) -> None:
    """Delete a cache directory (or a single store) made by this module; refuses anything else."""
    path = Path(path)
    if not path.exists():
        return
    if not cache_splits(path) and not (path / CACHE_INDEX).exists():
        raise UsageError(f"{path} is not an activation cache; not deleting it")
    shutil.rmtree(path)
