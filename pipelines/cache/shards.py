"""The work on one shard of a caching job, shared by the local job and Dask workers: device-to-host staging, a
shard's inputs (dataset tokens, or the states of a lower store), its forward, and writing it (with retries and
the options' `before_shard_write` hook)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping

import torch

from preinfer.errors import PreinferError, is_disk_full
from preinfer.staged import StagedModel
from preinfer.boundary_state import BoundaryState
from pipelines.data.batches import TokenSamples
from storage import Store, format_ranges, nonfinite_rows


class NonFiniteStates(PreinferError):
    """Computed boundary states hold NaN or inf: the shard is not written (and retrying cannot help)."""


# {field: (per-sample shape, torch dtype)} of the host buffers of one shard.
HostFields = Mapping[str, tuple[tuple[int, ...], torch.dtype]]


# ---- host staging (device-to-host copies) ---------------------------------------------------------------------


class _Ready:
    """The event of a copy that has already finished (CPU)."""

    def synchronize(self) -> None:
        pass


class HostStager:
    """Host buffers that finished boundary states are copied into, pooled and reused once written.

    With `asynchronous` (the default on CUDA) copies are `non_blocking` into pinned buffers and `fence()` records
    an event the writer waits on before it reads them; without CUDA the same code path runs with pageable
    buffers and an event that is already done, so it is exercised on CPU too.
    """

    def __init__(self, device: torch.device | str = "cpu", asynchronous: bool | None = None, max_pooled: int = 4):
        self.device = torch.device(device)
        self.asynchronous = self.device.type == "cuda" if asynchronous is None else asynchronous
        self.pin = self.asynchronous and self.device.type == "cuda" and torch.cuda.is_available()
        self.max_pooled = max_pooled
        self._pool: list[dict[str, torch.Tensor]] = []
        self._lock = threading.Lock()
        self.allocated = 0

    def acquire(self, fields: HostFields, samples: int) -> dict[str, torch.Tensor]:
        """Buffers {name: [samples, *shape]} (reused from the pool when one fits)."""
        want = {name: ((samples, *shape), dtype) for name, (shape, dtype) in fields.items()}
        with self._lock:
            for i, buffers in enumerate(self._pool):
                if {n: (tuple(t.shape), t.dtype) for n, t in buffers.items()} == want:
                    return self._pool.pop(i)
        self.allocated += 1
        return {name: torch.empty(shape, dtype=dtype, pin_memory=self.pin) for name, (shape, dtype) in want.items()}

    def copy(self, destination: torch.Tensor, source: torch.Tensor) -> None:
        destination.copy_(source, non_blocking=self.asynchronous)

    def fence(self):
        """An event that completes when every copy issued so far has landed in host memory."""
        if self.asynchronous and self.device.type == "cuda":
            event = torch.cuda.Event()
            event.record()
            return event
        return _Ready()

    def release(self, buffers: dict[str, torch.Tensor]) -> None:
        """Give written buffers back for reuse."""
        with self._lock:
            if len(self._pool) < self.max_pooled:
                self._pool.append(buffers)


# ---- inputs and the forward of one shard ----------------------------------------------------------------------


class DatasetInputs:
    """Boundary-0 states of dataset samples [a, b) on `device` (read from the dataset: a token store's split, or
    the tensors of one shard indexed from `offset`)."""

    start_layer = 0

    def __init__(self, staged: StagedModel, dataset: TokenSamples | Mapping[str, torch.Tensor], device, offset=0):
        self.staged, self.dataset, self.device, self.offset = staged, dataset, torch.device(device), offset

    def __call__(self, a: int, b: int) -> BoundaryState:
        if isinstance(self.dataset, Mapping):
            batch = {k: v[a - self.offset:b - self.offset] for k, v in self.dataset.items()}
        else:
            batch = self.dataset[a:b]
        batch = {k: v.to(self.device) for k, v in batch.items()}
        return self.staged.embed(batch["input_ids"], batch["attention_mask"], batch["labels"])


class StoreInputs:
    """Stored boundary states of samples [a, b) on `device`, hidden states in the compute dtype."""

    def __init__(self, store: Store, start_layer: int, device, dtype: torch.dtype):
        self.store, self.start_layer, self.device, self.dtype = store, start_layer, torch.device(device), dtype
        self._cached: tuple[int, dict[str, torch.Tensor]] | None = None

    def _shard(self, i: int) -> dict[str, torch.Tensor]:
        """Shard `i` as stored, a lossy encoding decoded (into the compute dtype: errors compound downstream)."""
        if self._cached is None or self._cached[0] != i:
            self._cached = (i, self.store.decode(self.store.read_shard(i), self.dtype))
        return self._cached[1]

    def __call__(self, a: int, b: int) -> BoundaryState:
        per = self.store.samples_per_shard
        pieces: dict[str, list[torch.Tensor]] = {}
        for i in range(a // per, (b - 1) // per + 1):
            lo, _ = self.store.shard_range(i)
            tensors = self._shard(i)
            for name, t in tensors.items():
                pieces.setdefault(name, []).append(t[max(a, lo) - lo:b - lo])
        tensors = {k: (v[0] if len(v) == 1 else torch.cat(v)).to(self.device) for k, v in pieces.items()}
        tensors["hidden"] = tensors["hidden"].to(self.dtype)
        return BoundaryState.from_dict(tensors)


def host_fields(store: Store, compute_dtype: torch.dtype) -> HostFields:
    """The host buffer layout of one shard of `store`: its written fields, a lossy one (encoded by the store when
    written) in the compute dtype."""
    return {name: (spec.shape, compute_dtype if name in store.encodings else spec.torch_dtype)
            for name, spec in ((n, store.fields[n]) for n in store.written_fields)}


def compute_shard(staged: StagedModel, inputs: Callable[[int, int], BoundaryState], start_layer: int, boundary: int,
                  lo: int, hi: int, batch_size: int, fields: HostFields, stager: HostStager):
    """Boundary states at `boundary` of samples [lo, hi), in batches of `batch_size` from `lo`, copied into host
    buffers; returns (buffers, fence)."""
    buffers = stager.acquire(fields, hi - lo)
    with torch.inference_mode():
        for a in range(lo, hi, batch_size):
            b = min(a + batch_size, hi)
            state = staged.run(inputs(a, b), start_layer, boundary)
            out = state.to_dict()
            out["hidden"] = out["hidden"].to(fields["hidden"][1])
            for name, tensor in out.items():
                stager.copy(buffers[name][a - lo:b - lo], tensor)
    return buffers, stager.fence()


# ---- writing one shard (retries, the hook) --------------------------------------------------------------------


def one_line(err: BaseException) -> str:
    """An error's message on one line (its type's name if it has none)."""
    text = str(err) or type(err).__name__
    return " ".join(text.split())


def write_shard(store: Store, split: str, shard: int, tensors: dict[str, torch.Tensor], retries: int = 0,
                before_write: Callable[[str, int], None] | None = None) -> int:
    """Write one shard, retrying a failure `retries` times (never a full disk), calling `before_write(split,
    shard)` before each attempt; returns the attempts made. States holding NaN or inf are refused (whatever the
    store dtype), naming the samples."""
    bad = nonfinite_rows(tensors["hidden"])
    if bad:
        lo, hi = store.shard_range(shard)
        raise NonFiniteStates(
            f"{split + ' ' if split else ''}shard {shard} (samples {lo}..{hi}): the boundary states of samples "
            f"{format_ranges([lo + r for r in bad])} hold NaN or inf (a diverged prefix?); nothing was stored"
        )
    attempts = 0
    while True:
        attempts += 1
        try:
            if before_write is not None:
                before_write(split, shard)
            store.write_shard(shard, tensors)
            return attempts
        except Exception as err:
            if attempts > retries or is_disk_full(err):
                raise
