"""The pre-inference caching job: run the frozen prefix once over a dataset and store the boundary states.

The public surface (what `preinfer cache` and `bcd --pre-inference` use; the model is already in memory):

- `cache_boundary`: embedding + layers [0, boundary) over every sample of each split, written to a cache
  directory: one complete `storage` store per split, `<out>/<split>/`, plus `<out>/cache.json` (an index
  written last, once every split is finalized).
- `roll_forward`: only layers [K, boundary) over the store(s) at boundary K of a cache directory (or of a
  single store, whose result is a single store too). The source must match the model's current prefix [0, K)
  and hold the compute dtype (lossless; the result, store and fingerprint, equals a fresh `cache_boundary`
  with the same weights, batch size and shard size) or a lossy encoding (its decoded states go through the
  layers: the encoding errors compound, see docs/results.md).
- `CacheOptions`: every option of a job, checked when made (see its fields); `parse_dask` reads `--dask`.
- `CacheResult`, `CacheJobError`, `cache_fingerprint`, `check_boundary`, `default_samples_per_shard` (and a run's
  `samples_per_shard`, so that live and stored runs read in the same order), `bytes_per_token` (of a store dtype,
  for cost models), the names a command offers (`DEFAULT_SPLITS`, `STORE_DTYPES`, `STORE_FORMATS`), and
  `open_cache` (the stores of a cache directory, or {"": store} for a single store).

What is stored, per sample i of a split's token samples (store sample i = dataset sample i, dataset order):
`hidden` [T, H] in the storage dtype, `attention_mask` [T] bool, `position_ids` [T] int64, `labels` [T] int64,
i.e. `BoundaryState.to_dict()` of one sample. `store_dtype="auto"` stores the compute dtype bit for bit; a lower
dtype (`bfloat16`, `float16`) is an explicit choice recorded in the fingerprint, and so is a lossy encoding
(`float8_e4m3`, `float8_e5m2`, `int8`: the store encodes `hidden` into 8-bit codes plus `hidden_scale` [T]
float32 and records each shard's decoding error). States holding NaN or inf are never stored (any dtype).

Batches never straddle shards: shard i covers samples [i*S, (i+1)*S) and is computed in batches of
`batch_size` from its first sample, so every way of running the job (resumed, rolled forward, on Dask) runs
the same forward batches and writes identical bytes. The default shard size aims at 64 MiB of hidden states
(`fingerprints.SHARD_TARGET_BYTES`), at least one sample.

`mode`: "resume" (default) reuses a store with the same fingerprint and computes only its missing shards (a
complete one is a no-op) and refuses a store with another fingerprint (StaleStoreError naming the differing
parts); "overwrite" deletes what is there and rebuilds; "refuse" fails if anything is at `out` already.

Modules: `options` (CacheOptions, parse_dask), `fingerprints` (what a store is), `directory` (a cache directory
and its index), `build` (the two entry points: plan, run, finalize), `work` (a split's planned work), `shards`
(the work on one shard, shared with the Dask workers), `local_runner`, `dask_runner`, `result`,
`report` (inspect and verify), `worker_imports` (the Dask worker plugin); the progress bar is
`pipelines.progress.Progress`.

Single process: the forward runs on the calling thread; finished shards go through a bounded queue
(`local_runner.QUEUE_DEPTH`) to a writer thread, so compression and fsync overlap the next shard's forward.
Host copies go into pooled buffers (`HostStager`); on CUDA these are pinned, filled by non_blocking
device-to-host copies, and the writer waits on an event recorded after the last copy before it touches them.

Dask (`dask="local:N"`, `"tcp://host:port"` or a `distributed.Client`): one task per shard, each computing and
writing its own shard, retried `retries` times. Workers load the model themselves from `model_name` (a preset,
a save_pretrained directory or a BCD run directory, with `model_seed` for presets) once per worker, and check
that its prefix digest equals the one the client expects (a run directory whose checkpoint moved on is
reloaded once; otherwise the task fails). `local:N` starts N worker processes with one Dask thread each and
`max(1, cores // N)` torch threads; the cluster stays up for the next `local:N` job of the same process until
exit or `dask_runner.shutdown_local_clusters()`. Remote workers need this package installed and the store path
(and a roll-forward's source) on a shared filesystem.

Imports on Dask workers: a worker started with the `dask worker` CLI has its local directory first on `sys.path`
and keeps its spill files in `<local directory>/storage`; with the package installed editable (setuptools' finder
runs after the path finder) `import storage` would find that empty directory as a namespace package. The client
therefore registers a worker plugin (`worker_imports`) that imports `storage`, `preinfer` and `pipelines` on each
worker with such shadowing `sys.path` entries left out, before any task of ours is unpickled. We chose the plugin
over renaming the packages (the design fixes the three top-level folders) and over changing how the package is
installed (a user's `pip install -e .` would still break): it needs nothing on the workers but the installed
package, also covers workers that join later, and touches nothing else in the worker. The plugin is pickled by
value, so unpickling it imports none of our modules.

Several processes can run one job together (the ranks of a torchrun job building a store for pre-inference):
each passes its `Part` in the options, computes the shards i with i % count == index, and meets the others at
the part's barrier after the first part made the stores, after every shard is written, and after the first part
finalized them; the stores must be where every process sees them (one disk, a shared filesystem, object storage).

Test hooks come from the caller: `CacheOptions.before_shard_write(split, shard)` runs before every attempt to
write a shard (tests inject faults and delays with it; it travels to the Dask workers with each task).
"""

from pipelines.cache.build import cache_boundary, roll_forward
from pipelines.cache.directory import DEFAULT_SPLITS, open_cache
from pipelines.cache.fingerprints import (
    bytes_per_token, cache_fingerprint, check_boundary, default_samples_per_shard, samples_per_shard,
)
from pipelines.cache.options import STORE_DTYPES, STORE_FORMATS, CacheOptions, Part, parse_dask
from pipelines.cache.result import CacheJobError, CacheResult

__all__ = [
    "cache_boundary", "roll_forward", "open_cache", "CacheOptions", "Part", "CacheResult", "CacheJobError",
    "cache_fingerprint", "check_boundary", "default_samples_per_shard", "samples_per_shard", "parse_dask",
    "bytes_per_token",
    "DEFAULT_SPLITS", "STORE_DTYPES", "STORE_FORMATS",
]
