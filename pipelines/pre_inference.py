"""Pre-inference inside a BCD run: which visits train from a store of boundary states, and keeping those
stores valid.

For a visit of a block starting at layer k > 0, `on` trains from a store at boundary k and `off` runs the prefix
live. `auto` decides per visit with a cost model: building the store (a fresh prefix run over the data, or a
roll-forward from a valid store at a lower boundary) plus reading it each step, against the prefix forward it
saves each step over the visit's expected steps; throughputs are measured on this machine, and a store that
would not fit on the disk is never built. Every decision is logged with its numbers.

A store is used only while its fingerprint matches the current prefix. Stores are made by the same code as
`preinfer cache`: an ascending sweep runs the prefix from the input once and rolls the store forward past
each trained block; a descending sweep builds the stores it needs at its start, each rolled forward from the
one below. Stores no longer usable are deleted unless `keep_stores`.
"""

from __future__ import annotations

import shutil
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from preinfer.config import Config
from preinfer.metrics import CacheRecord, PreInferenceRecord, Record
from preinfer.partition import Block
from preinfer.run_dir import RunDir
from preinfer.sources import BatchSource
from preinfer.staged import StagedModel
from storage import StorageError
from pipelines.cache import CacheOptions, cache_boundary, cache_fingerprint, open_cache, roll_forward
from pipelines.sources import ReaderBatches

# Until a store has been read on this machine, assume this read speed (bytes/s) for the cost model.
ASSUMED_READ_BPS = 300e6
# Until a store has been written, assume this write speed (bytes/s).
ASSUMED_WRITE_BPS = 150e6
# Keep this share of the free disk space untouched.
DISK_RESERVE = 0.1


@dataclass
class Estimate:
    """The auto rule's numbers for one visit (seconds, bytes)."""

    steps: int
    prefix_per_step: float
    read_per_step: float
    eval_prefix: float  # the prefix forward the visit's evaluation skips when it reads the eval store
    build: float
    build_from: int
    store_bytes: int
    free_bytes: int

    @property
    def saving(self) -> float:
        return self.steps * (self.prefix_per_step - self.read_per_step) + self.eval_prefix - self.build

    @property
    def use_store(self) -> bool:
        return self.saving > 0 and self.store_bytes < (1 - DISK_RESERVE) * self.free_bytes


class PreInference:
    """A `preinfer.sources.VisitSources` that trains blocks above the input from stores (mode `on` or `auto`)."""

    def __init__(self, staged: StagedModel, datasets: dict, tokenizer, config: Config, live, shard: int,
                 rank: int = 0, world: int = 1):
        self.staged, self.datasets, self.tokenizer, self.config = staged, datasets, tokenizer, config
        self.live, self.shard, self.rank, self.world = live, shard, rank, world
        self.mode = config.pre_inference.mode
        self.root = Path(config.pre_inference.store_dir or RunDir(config.run.out).stores)
        settings = config.pre_inference  # checked here, before the run directory is made
        self.options = CacheOptions(store_format=settings.store_format, store_dtype=settings.store_dtype,
                                    samples_per_shard=shard, mode="overwrite", progress=False,
                                    model_name=config.model.name, dask=settings.dask)
        self.stores: dict[int, Path] = {}  # boundary -> cache directory believed valid
        self.emit: Callable[[Record], None] = lambda record: None
        self.read_bps, self.write_bps = ASSUMED_READ_BPS, ASSUMED_WRITE_BPS
        self.layer_seconds: float | None = None  # no_grad forward of one layer over one sample
        self.remaining: list[Block] = []

    def attach(self, emit: Callable[[Record], None]) -> None:
        self.emit = emit

    def sweep_started(self, blocks: list[Block]) -> None:
        """Descending sweeps build every store they will use now, each rolled forward from the one below."""
        self.remaining = list(blocks)
        starts = [b.start for b in blocks if b.start > 0]
        if self.mode == "on" and starts == sorted(starts, reverse=True):
            for start in sorted(starts):
                self._ensure(start)

    def sources(self, block: Block) -> tuple[BatchSource, BatchSource]:
        if block in self.remaining:
            self.remaining.remove(block)
        if block.start == 0 or self.mode == "off" or not self._decide(block):
            return self.live.train, self.live.eval
        path = self._ensure(block.start)
        stores = open_cache(path, splits=["train", "eval"])
        batch, seed = self.config.data.batch_size, self.config.run.seed
        return (ReaderBatches(stores["train"], block.start, batch, seed, self.rank, self.world),
                ReaderBatches(stores["eval"], block.start, batch, seed, shuffle=False))

    def visit_finished(self, block: Block) -> None:
        """Drop the stores the trained block made stale (those above its first layer)."""
        for boundary in [b for b in self.stores if b > block.start]:
            self._delete(boundary, reason=f"block {block.index} changed layers below it")

    # ---- decisions ---------------------------------------------------------------------------------------------
    def _decide(self, block: Block) -> bool:
        if self.mode == "on":
            return True
        estimate = self._estimate(block)
        use = estimate.use_store
        self.emit(PreInferenceRecord(block=block.index, boundary=block.start, decision="store" if use else "live",
                                     **vars(estimate), saving_s=estimate.saving))
        return use

    def _estimate(self, block: Block) -> Estimate:
        k, train = block.start, self.datasets["train"]
        per_layer = self._layer_seconds()
        stop, optim = self.config.stop, self.config.optim
        steps_per_epoch = -(-len(train) // (self.config.data.batch_size * self.world)) // optim.grad_accum or 1
        budgets = [s for s in (stop.steps_per_visit,
                               stop.epochs_per_visit and int(stop.epochs_per_visit * steps_per_epoch)) if s]
        steps = min(budgets) if budgets else steps_per_epoch
        samples_per_step = self.config.data.batch_size * optim.grad_accum
        eval_samples = len(self.datasets["eval"])  # capped by --eval-tokens
        sample_bytes = train.seq_len * self.staged.hidden_size * self.staged.compute_dtype.itemsize
        total = sum(len(d) for d in self.datasets.values())
        source = max((b for b in self._valid_stores() if b < k), default=0)
        build = (k - source) * per_layer * total + total * sample_bytes * (
            1 / self.write_bps + (1 / self.read_bps if source else 0))
        return Estimate(
            steps=steps,
            prefix_per_step=k * per_layer * samples_per_step,
            read_per_step=samples_per_step * sample_bytes / self.read_bps,
            eval_prefix=eval_samples * (k * per_layer - sample_bytes / self.read_bps),
            build=0.0 if k in self._valid_stores() else build,
            build_from=source,
            store_bytes=total * sample_bytes,
            free_bytes=shutil.disk_usage(next(p for p in (self.root, *self.root.parents) if p.exists())).free,
        )

    @torch.no_grad()
    def _layer_seconds(self) -> float:
        """Median time of one layer's no_grad forward over one sample, measured once on a training batch."""
        if self.layer_seconds is None:
            batch = self.datasets["train"][: self.config.data.batch_size]
            device = next(p for p in self.staged.model.parameters() if not p.is_meta).device
            state = self.staged.embed(*(batch[k].to(device) for k in ("input_ids", "attention_mask", "labels")))
            times = []
            for _ in range(3):
                started = time.perf_counter()
                self.staged.run(state, 0, 1)
                times.append(time.perf_counter() - started)
            self.layer_seconds = statistics.median(times) / len(batch["input_ids"])
        return self.layer_seconds

    # ---- stores ------------------------------------------------------------------------------------------------
    def _valid_stores(self) -> list[int]:
        return [b for b in self.stores if self._is_valid(b)]

    def _is_valid(self, boundary: int) -> bool:
        expected = cache_fingerprint(self.staged, self.datasets["train"], self.tokenizer, boundary,
                                     self.config.pre_inference.store_dtype)
        try:
            stores = open_cache(self.stores[boundary], splits=["train"])
        except StorageError:  # damaged or half-deleted: not usable, rebuilt on demand
            return False
        return stores["train"].fingerprint.digest == expected.digest

    def _ensure(self, boundary: int) -> Path:
        """A valid store at `boundary`: reused, rolled forward from the nearest valid lower one, or made fresh."""
        if boundary in self.stores and self._is_valid(boundary):
            self.emit(CacheRecord(boundary=boundary, how="reuse", seconds=0.0, bytes=0))
            return self.stores[boundary]
        out = self.root / f"boundary-{boundary}"
        source = max((b for b in self._valid_stores() if b < boundary), default=0)
        if source:
            result = roll_forward(self.staged, self.stores[source], boundary, out, self.options)
        else:
            result = cache_boundary(self.staged, self.datasets, self.tokenizer, boundary, out, self.options)
        self.stores[boundary] = out
        if result.write_seconds > 0:  # the writer's own time: the forward is estimated separately
            self.write_bps = max(result.bytes_written / result.write_seconds, 1.0)
        self.emit(CacheRecord(boundary=boundary, how="roll_forward" if source else "input", from_=source,
                              seconds=result.seconds, bytes=result.bytes_written))
        if source and not any(b.start == source for b in self.remaining):
            self._delete(source, reason=f"rolled forward to boundary {boundary}")
        return out

    def _delete(self, boundary: int, reason: str) -> None:
        path = self.stores.pop(boundary)
        if not self.config.pre_inference.keep_stores:
            shutil.rmtree(path, ignore_errors=True)
            self.emit(CacheRecord(boundary=boundary, how="deleted", reason=reason, seconds=0.0, bytes=0))
