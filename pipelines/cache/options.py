"""The caching job's options: `CacheOptions`, checked when made, and `parse_dask`, the one `--dask` parser."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from preinfer.config.choices import STORE_DTYPES as STORE_DTYPE_NAMES
from preinfer.errors import UsageError
from storage import StorageError, codec_spec

# Exact store dtypes (bit for bit), then the lossy encodings (8-bit codes and a per-token scale, storage.encodings):
# `preinfer.config.choices.STORE_DTYPES` as torch's dtypes (float8_e4m3 is torch's "fn" variant, without inf).
STORE_DTYPES = {name: getattr(torch, {"float8_e4m3": "float8_e4m3fn"}.get(name, name)) for name in STORE_DTYPE_NAMES}
MODES = ("resume", "overwrite", "refuse")
STORE_FORMATS = ("zarr", "safetensors")


@dataclass(frozen=True)
class LocalWorkers:
    """`--dask local:N`: a LocalCluster of N worker processes started by this process."""

    workers: int

    @property
    def torch_threads(self) -> int:
        """Torch threads per worker: the cores shared out."""
        return max(1, (os.cpu_count() or 1) // self.workers)

    def __str__(self) -> str:
        return f"local:{self.workers}"


@dataclass(frozen=True)
class SchedulerAddress:
    """`--dask tcp://host:port`: the scheduler of a running Dask cluster."""

    address: str

    def __str__(self) -> str:
        return self.address


DaskTarget = LocalWorkers | SchedulerAddress


@dataclass(frozen=True)
class Part:
    """This process's share of a caching job that `count` processes run together (the ranks of a torchrun job,
    writing one store that all of them can see): shards i with i % count == index. The first part creates the
    stores and finalizes them; `barrier` returns once every part has called it."""

    index: int
    count: int
    barrier: Callable[[], None]

    def __post_init__(self) -> None:
        if not 0 <= self.index < self.count:
            raise UsageError(f"part {self.index} of {self.count}: expected 0 <= part < count")

    @property
    def first(self) -> bool:
        return self.index == 0

    def mine(self, shards: list[int]) -> list[int]:
        return [i for i in shards if i % self.count == self.index]


def parse_dask(text: str, flag: str = "--dask") -> DaskTarget:
    """"local:N" (N >= 1) or a scheduler address such as "tcp://host:8786"; a UsageError naming `flag` otherwise."""
    if text.startswith("local:"):
        count = text.removeprefix("local:")
        if not count.isdigit() or int(count) < 1:
            raise UsageError(f"{flag} {text!r}: expected local:N with N >= 1 workers")
        return LocalWorkers(int(count))
    if "://" not in text:
        raise UsageError(f"{flag} {text!r}: expected local:N or a scheduler address such as tcp://host:8786")
    return SchedulerAddress(text)


def store_dtype_name(dtype: str | torch.dtype | None) -> str:
    """A storage dtype as a name: "auto" (the compute dtype) or one of STORE_DTYPES."""
    if dtype is None or dtype == "auto":
        return "auto"
    names = {value: name for name, value in STORE_DTYPES.items()}
    if isinstance(dtype, torch.dtype) and dtype in names:
        return names[dtype]
    if dtype in STORE_DTYPES:
        return dtype
    raise UsageError(f"--store-dtype {dtype!r} is not one of auto, {', '.join(STORE_DTYPES)}")


def resolve_store_dtype(dtype: str | torch.dtype | None, compute_dtype: torch.dtype) -> torch.dtype:
    """The dtype hidden states are stored in: "auto" is the compute dtype."""
    name = store_dtype_name(dtype)
    return compute_dtype if name == "auto" else STORE_DTYPES[name]


def _positive(flag: str, value: Any, minimum: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        wanted = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
        raise UsageError(f"{flag} must be {wanted}, got {value!r}")


@dataclass(frozen=True)
class CacheOptions:
    """How a caching job runs and what its stores look like; every value is checked when the options are made
    (a one-line UsageError naming the flag).

    `store_dtype` "auto" stores the compute dtype bit for bit; float8_e4m3, float8_e5m2 and int8 are lossy (each
    shard's decoding error is measured and recorded). `dask`: None (this process), "local:N",
    "tcp://host:port" (parsed into a `DaskTarget`) or a `distributed.Client`. `before_shard_write(split, shard)` is
    called before every attempt to write a shard, on the Dask workers too (so it must pickle: a module-level
    function or a functools.partial of one). `part`: None (this process runs the whole job) or this process's
    `Part` of a job run by several processes at once (no Dask then). `out_flag`: the flag that chose the output
    directory, as messages name it."""

    store_format: str = "zarr"
    store_dtype: str = "auto"
    codec: str | None = None
    batch_size: int = 16
    samples_per_shard: int | None = None
    mode: str = "resume"
    model_name: str = ""
    model_seed: int = 0
    progress: bool = True
    dask: Any = None
    retries: int = 2
    device: str | None = None
    before_shard_write: Callable[[str, int], None] | None = None
    part: Part | None = None
    out_flag: str = "--out"  # how messages name where the job writes (bcd's pre-inference: --store-dir)

    def __post_init__(self) -> None:
        if self.store_format not in STORE_FORMATS:
            raise UsageError(f"--store-format {self.store_format!r} is not one of {', '.join(STORE_FORMATS)}")
        if self.mode not in MODES:
            raise UsageError(f"mode {self.mode!r} is not one of {', '.join(MODES)}")
        _positive("--batch-size", self.batch_size)
        if self.samples_per_shard is not None:
            _positive("--samples-per-shard", self.samples_per_shard)
        _positive("--retries", self.retries, minimum=0)
        try:
            codec_spec(self.store_format, self.codec)
        except StorageError as err:
            raise UsageError(f"--codec: {err}") from None
        object.__setattr__(self, "store_dtype", store_dtype_name(self.store_dtype))
        if isinstance(self.dask, str):
            object.__setattr__(self, "dask", parse_dask(self.dask))
        if self.device is not None:
            object.__setattr__(self, "device", str(torch.device(self.device)))
        if self.part is not None and self.dask is not None:
            raise UsageError("--dask: under data parallelism the ranks build each store together (each its share "
                             "of the shards); drop --dask, or run the caching job on Dask with `preinfer cache`")

    def for_model(self, compute_dtype: torch.dtype, device: torch.device | str) -> CacheOptions:
        """These options with "auto" and an unset device made concrete for a model."""
        dtype = resolve_store_dtype(self.store_dtype, compute_dtype)
        return dataclasses.replace(self, store_dtype=store_dtype_name(dtype), device=str(self.device or device))

    @property
    def dtype(self) -> torch.dtype:
        """The storage dtype (after `for_model`)."""
        return STORE_DTYPES[self.store_dtype]

    @property
    def workers(self) -> str:
        """What runs the shards: "1" (this process), the Dask target, or the address of a Client's scheduler."""
        if self.dask is None:
            return "1"
        if isinstance(self.dask, (LocalWorkers, SchedulerAddress)):
            return str(self.dask)
        return f"dask {getattr(self.dask, 'scheduler', None) and self.dask.scheduler.address}"
