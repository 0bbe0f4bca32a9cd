"""The caching job's two entry points, `cache_boundary` and `roll_forward`: they check their input, plan one
`SplitJob` per split (its store created or reopened, the shards still to do), run the shards here or on Dask,
then finalize the stores and write the cache index."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
from collections.abc import Mapping
from typing import Any

import torch

from pipelines.data.batches import TokenSamples
from preinfer.errors import UsageError
from preinfer.fingerprint import prefix_digest
from preinfer.staged import StagedModel
from storage import (
    LayoutMismatchError, Location, StaleStoreError, Store, create_store, is_lossy, location, open_store,
)
from pipelines.cache import dask_runner
from pipelines.cache.directory import (
    CACHE_FORMAT, CACHE_INDEX, cache_splits, check_out, holds_only_store_entries, read_index,
    write_index,
)
from pipelines.cache.fingerprints import (
    check_boundary, default_samples_per_shard, dtype_name, state_fingerprint, store_fields,
)
from pipelines.cache.local_runner import run_local
from pipelines.cache.options import CacheOptions, Part
from pipelines.cache.result import CacheJobError, CacheResult, failure
from pipelines.cache.shards import DatasetInputs, StoreInputs
from pipelines.cache.work import Failure, SplitJob, SplitResult
from pipelines.jobs.output import check_not_a_file, held_output
from pipelines.progress import Progress


def _model_device(staged: StagedModel) -> torch.device:
    return next(iter(staged.model.parameters())).device


def cache_boundary(staged: StagedModel, datasets: Mapping[str, TokenSamples], tokenizer: Any, boundary: int,
                   out: str | os.PathLike, options: CacheOptions = CacheOptions(),
                   prefix: str | None = None) -> CacheResult:
    """Store the boundary states at `boundary` of every sample of each split in `datasets` under `out/<split>/`,
    then the index `out/cache.json`. `prefix`: the prefix digest, when `staged` does not hold the whole prefix
    (a pipeline stage's view of it); None: computed from `staged`."""
    started = time.perf_counter()
    check_boundary(staged, boundary)
    opts = _after_the_first_part(options.for_model(staged.compute_dtype, _model_device(staged)))
    if not datasets:
        raise UsageError("no splits to cache")
    out = location(out)
    dask_runner.check_reachable(opts.dask)  # before anything is written
    with _owning(out, opts):
        check_out(out, list(datasets), opts.mode, opts.out_flag)
        prefix = prefix if prefix is not None else prefix_digest(staged, boundary)
        token_fp = tokenizer.fingerprint()
        jobs = []
        for name, dataset in datasets.items():
            fp = state_fingerprint(prefix, boundary, dataset.fingerprint(), token_fp, dataset.seq_len,
                                   opts.store_dtype, staged.attention,
                                   opts.model_name)
            fields = store_fields(dataset.seq_len, staged.hidden_size, opts.dtype)
            jobs.append(_split_work(name, out / name, fields, len(dataset), dataset.num_tokens, fp, opts,
                                    DatasetInputs(staged, dataset, opts.device), 0, dataset=dataset))
        return _run_jobs(staged, jobs, out, boundary, 0, opts, started)


def roll_forward(staged: StagedModel, source: str | os.PathLike, boundary: int, out: str | os.PathLike,
                 options: CacheOptions = CacheOptions(), splits: list[str] | None = None) -> CacheResult:
    """The stores at `boundary` made from the stores at boundary K in `source` (a cache directory, or a single
    store; `out` is then a single store too) by running only layers [K, boundary). The source must match the
    model's current prefix [0, K) and hold the compute dtype (the result then equals a fresh `cache_boundary`) or a
    lossy encoding (its decoded states are rolled forward, so encoding errors compound: see docs/results.md)."""
    started = time.perf_counter()
    opts = _after_the_first_part(options.for_model(staged.compute_dtype, _model_device(staged)))
    source, out = location(source), location(out)
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
    dask_runner.check_reachable(opts.dask)
    with _owning(out, opts):
        check_out(out, list(found), opts.mode, opts.out_flag)
        return _roll_forward_jobs(staged, found, source, boundary, out, opts, started)


def _roll_forward_jobs(staged: StagedModel, found: dict[str, Location], source: Location, boundary: int,
                       out: Location, opts: CacheOptions, started: float) -> CacheResult:
    """Check each source store against the model's prefix, plan its split and run them (see `roll_forward`)."""
    compute = dtype_name(staged.compute_dtype)
    jobs = []
    source_boundary = None
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
        if src_dtype != compute and not is_lossy(src_dtype):
            raise UsageError(
                f"--from-store {path} holds {src_dtype} hidden states but the model computes in {compute}: rolling "
                f"forward from a lower dtype would not equal a fresh run; cache boundary {boundary} from the input "
                f"instead"
            )
        for b in (k, boundary):
            prefixes.setdefault(b, prefix_digest(staged, b))
        expected = state_fingerprint(prefixes[k], k, data_fp, token_fp, seq_len, src_dtype, staged.attention,
                                     str(parts.get("model", "")))
        if expected.digest != src.fingerprint.digest:
            raise StaleStoreError(
                f"--from-store {path} does not match the model's current prefix [0, {k}) "
                f"({'; '.join(src.fingerprint.differences(expected)) or 'digest differs'}); it cannot be rolled "
                f"forward, cache boundary {boundary} from the input instead"
            )
        src.require_complete()
        fp = state_fingerprint(prefixes[boundary], boundary, data_fp, token_fp, seq_len, opts.store_dtype,
                               staged.attention, opts.model_name)
        fields = store_fields(seq_len, staged.hidden_size, opts.dtype)
        target = out if name == "" else out / name
        jobs.append(_split_work(name, target, fields, src.num_samples, _stored_tokens(src, source, name), fp, opts,
                                StoreInputs(src, k, opts.device, staged.compute_dtype), k, source_path=path,
                                source_digest=src.fingerprint.digest))
    return _run_jobs(staged, jobs, out, boundary, source_boundary, opts, started)


# ---- planning ---------------------------------------------------------------------------------------------------


def _owning(out: Location, opts: CacheOptions) -> contextlib.AbstractContextManager:
    """The output `out` held for this job (`held_output`); a part of a shared job other than the first writes under
    the first's hold."""
    if opts.part is None or opts.part.first:
        return held_output(out, opts.out_flag)
    check_not_a_file(out, opts.out_flag)
    return contextlib.nullcontext()


def _after_the_first_part(opts: CacheOptions) -> CacheOptions:
    """A part of a shared job other than the first waits until the first has made the stores, then resumes them."""
    if opts.part is None or opts.part.first:
        return opts
    opts.part.barrier()
    return dataclasses.replace(opts, mode="resume")


def _prepare_store(path: Location, split: str, fields, num_samples: int, per_shard: int, fingerprint,
                   opts: CacheOptions) -> Store:
    """Create the store of one split, or reopen the one there to resume it (refusing another fingerprint)."""
    where = f"{split} store {path}" if split else f"store {path}"
    check_not_a_file(path, opts.out_flag)
    overwrite = opts.mode == "overwrite"
    if overwrite and path.is_dir() and not holds_only_store_entries(path):
        raise UsageError(f"{path} is not an activation store; not deleting it (choose another {opts.out_flag})")
    try:
        return create_store(path, fields, num_samples, per_shard, fingerprint, format=opts.store_format,
                            codec=opts.codec, overwrite=overwrite)
    except StaleStoreError:
        stored = open_store(path, check_files=False).fingerprint
        raise StaleStoreError(
            f"{where} was built for another fingerprint ({'; '.join(stored.differences(fingerprint))}); "
            f"pass --overwrite to rebuild it, or choose another {opts.out_flag}"
        ) from None
    except LayoutMismatchError as err:
        differs = [f"{name} {old!r} (now {new!r})" for name, (old, new) in err.differences.items()]
        raise UsageError(
            f"{where} has the same fingerprint but another layout: {', '.join(differs)}; resume it with the "
            f"options it was made with, or pass --overwrite to rebuild it"
        ) from None


def _split_work(name: str, path: Location, fields, num_samples: int, tokens: int, fingerprint, opts: CacheOptions,
                inputs, start_layer: int, **extra) -> SplitJob:
    """The planned work of one split: its store ready to resume, and the shards it still lacks."""
    seq_len, hidden_size = fields["hidden"][0]
    per_shard = opts.samples_per_shard or default_samples_per_shard(seq_len, hidden_size, opts.dtype)
    store = _prepare_store(path, name, fields, num_samples, per_shard, fingerprint, opts)
    todo = store.missing_shards()
    result = SplitResult(name, path, fingerprint, num_samples, tokens, store.num_shards,
                         shards_skipped=store.num_shards - len(todo))
    return SplitJob(name, store, inputs, start_layer, result, todo, **extra)


def _stored_tokens(store: Store, source: Location, split: str) -> int:
    """Real tokens of a store: from its cache index when the index describes this very store, else counted."""
    try:
        entry = read_index(source)["splits"][split]
        if entry["fingerprint"] == store.fingerprint.digest:
            return int(entry["tokens"])
    except (KeyError, TypeError, ValueError):
        pass
    return sum(int(store.read_shard(i, ["attention_mask"])["attention_mask"].sum()) for i in range(store.num_shards))


# ---- running and finishing ----------------------------------------------------------------------------------------


def _run_shards(staged: StagedModel, jobs: list[SplitJob], boundary: int, opts: CacheOptions,
                timing: dict[str, float]) -> tuple[list[Failure], BaseException | None, dict[str, int]]:
    """Compute and write the shards of `jobs` still to do, in this process or on Dask; returns (the shards that
    failed, the error that stopped the job or None, model loads per Dask worker)."""
    progress = Progress(quiet=not opts.progress)
    progress.start("cache", "sample", sum(job.todo_samples() for job in jobs), dynamic_ncols=True)
    try:
        if opts.dask is not None:
            return dask_runner.run(staged, jobs, boundary, opts, progress, timing)
        failed, fatal = run_local(staged, jobs, boundary, opts, progress, timing)
        return failed, fatal, {}
    finally:
        progress.close()


def _run_jobs(staged: StagedModel, jobs: list[SplitJob], out: Location, boundary: int, source_boundary: int,
              opts: CacheOptions, started: float) -> CacheResult:
    single = len(jobs) == 1 and jobs[0].name == ""
    index = out / CACHE_INDEX
    part = opts.part
    first = part is None or part.first
    if first and not single and any(job.todo for job in jobs) and index.exists():
        index.unlink()  # the index describes only finished caches
    if part is not None:
        if part.first:
            part.barrier()  # the stores are made: the other parts open them
        for job in jobs:
            job.todo = part.mine(job.todo)
    model_loads: dict[str, int] = {}
    timing = {"forward": 0.0, "write": 0.0, "blocked": 0.0}
    if any(job.todo for job in jobs):
        failed, fatal, model_loads = _run_shards(staged, jobs, boundary, opts, timing)
        if fatal is not None or failed:
            raise failure(jobs, failed, fatal)
    if part is not None:
        part.barrier()  # every part's shards are written
        _require_shared(jobs, part)
    if first:
        _finalize(jobs)
    result = CacheResult(
        path=out, boundary=boundary, splits={job.name: job.result for job in jobs},
        samples=sum(j.result.samples for j in jobs), tokens=sum(j.result.tokens for j in jobs),
        bytes_written=sum(j.result.bytes_written for j in jobs), seconds=time.perf_counter() - started,
        shards_computed=sum(j.result.shards_computed for j in jobs),
        shards_skipped=sum(j.result.shards_skipped for j in jobs), source_boundary=source_boundary,
        store_dtype=opts.store_dtype, store_format=opts.store_format, workers=opts.workers, model_loads=model_loads,
        forward_seconds=timing["forward"], write_seconds=timing["write"], blocked_seconds=timing["blocked"],
    )
    if first and not single:
        try:
            write_index(out, _index(result))
        except OSError as err:
            raise failure(jobs, [], err, out) from None
    if part is not None:
        part.barrier()  # the stores are finalized and indexed
        if not first:
            _count_stored_bytes(jobs)
    return result


def _require_shared(jobs: list[SplitJob], part: Part) -> None:
    """Refuse stores in which this process does not see every part's shards (each part wrote where only it sees)."""
    for job in jobs:
        missing = job.store.missing_shards()
        if missing:
            raise CacheJobError(
                f"{job.store.path}: part {part.index} of {part.count} of a shared caching job does not see "
                f"{len(missing)} of its {job.store.num_shards} shards, which the other parts wrote; the processes "
                f"(the ranks of a torchrun job) must write one store that all of them see: on a shared filesystem "
                f"or object storage (s3://), e.g. with --store-dir")


def _finalize(jobs: list[SplitJob]) -> None:
    """Fold each store's completion records into its manifest (a no-op rewrite when complete) and count its bytes."""
    for job in jobs:
        try:
            job.store.finalize()
        except OSError as err:
            raise failure(jobs, [], err, job.store.path) from None
    _count_stored_bytes(jobs)


def _count_stored_bytes(jobs: list[SplitJob]) -> None:
    try:
        for job in jobs:
            job.result.stored_bytes = job.store.size_info()["stored_bytes"]
    except OSError as err:
        raise failure(jobs, [], err) from None


def _index(result: CacheResult) -> dict[str, Any]:
    """The cache index of a finished job."""
    return {
        "format": CACHE_FORMAT, "version": 1, "boundary": result.boundary, "dtype": result.store_dtype,
        "backend": result.store_format, "complete": True,
        "splits": {name: {"path": name, "fingerprint": s.fingerprint.digest, "samples": s.samples,
                          "tokens": s.tokens, "shards": s.num_shards, "stored_bytes": s.stored_bytes}
                   for name, s in result.splits.items()},
    }
