"""Pre-inference inside a BCD run: the executor of the sweep plans of `pipelines.training.sweep_plan`, and keeping the
stores it makes valid.

For a visit of a block starting at layer k > 0, `on` trains from a store at boundary k and `off` runs the prefix
live. At the start of every sweep, `auto` prices whole-sweep plans (which visits read a store, how each store
is made: from the input, rolled forward from a lower store, or reused; when each is deleted; the disk at the
plan's peak) against running the sweep live, with the throughputs measured in this run, and follows the
cheaper; `on` follows the plan in which every visit above the input reads a store, and builds no store that no
visit reads. The throughputs of stores are measured over every store made so far (`Tally`); when one moves by
more than `sweep_plan.REVISE_MARGIN` from the one a plan assumed, the rest of the sweep is planned again. Every
plan, and at the end of each sweep its predicted against its measured seconds, is logged with its numbers
(metrics.jsonl and one line each).

A store is used only while its fingerprint matches the current prefix: a store the plan expected is checked
before it is read, and made again if stale. Stores are made by the same code as `preinfer cache`. Stores no
longer usable, or no longer read by the plan, are deleted unless `keep_stores`.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from preinfer.config import Config
from preinfer.errors import UsageError
from preinfer.metrics import CacheRecord, PlanOutcomeRecord, PreInferenceRecord, Record, SweepPlanRecord
from preinfer.optim import step_budget
from preinfer.partition import Block
from preinfer.run_dir import RunDir
from preinfer.batch_source import BatchSource
from preinfer.staged import StagedModel
from storage import Location, StorageError, free_bytes, location, remove_tree
from pipelines.training import sweep_plan
from pipelines.cache import (
    CacheOptions, CacheResult, Part, bytes_per_token, cache_boundary, cache_fingerprint, open_cache, roll_forward,
)
from pipelines.data.batches import ReaderBatches
from pipelines.training.sweep_plan import (Plan, SweepPlan, Throughputs, Visit, Workload, plan_sweep, store_cost,
                                  visit_seconds)

# Timed forwards of one layer over one training batch that give the first estimate of the prefix's speed.
LAYER_PROBES = 5
# Before the first plan of `auto` (when a store could pay at all), a store of the first training samples (one
# shard, at most this many bytes of states) is written, read back and deleted, to time the store's disk, codec
# and format on this machine.
PROBE_BYTES = 8 * 2**20
# `on` plans without the probe: until a store has been written and read, it assumes these speeds (bytes/s).
ASSUMED_WRITE_BPS = 150e6
ASSUMED_READ_BPS = 300e6
# Until the probe or a store has measured it, a store's fixed cost (seconds: open, check, finalize, index, delete;
# the probe measured 0.04-0.06 s on the development machine, later stores 0.01-0.04 s).
ASSUMED_STORE_OVERHEAD_S = 0.05
# What the probe itself is assumed to cost (seconds; 0.14-0.35 s in a fresh process on the development machine):
# it is made only when a store could save more than this beyond `sweep_plan.STORE_MARGIN`, so that runs too short
# for stores to matter do not pay for it.
PROBE_COST_S = 0.2


@dataclasses.dataclass
class Tally:
    """Sums over the stores this run has made: each throughput is a ratio of two sums, steadier on a loaded
    machine than the last store's alone (so the plan is not revised on one slow or fast build)."""

    forward_seconds: float = 0.0
    layer_samples: int = 0  # one layer's forward over one sample, counted over every build
    write_seconds: float = 0.0
    write_bytes: int = 0
    overhead_seconds: float = 0.0  # each build's time beyond its forward and its bytes, and each deletion
    builds: int = 0


class PreInference:
    """A `preinfer.batch_source.VisitSources` that trains blocks above the input from stores (mode `on` or `auto`)."""

    def __init__(self, staged: StagedModel, datasets: dict, tokenizer, config: Config, live, shard: int,
                 rank: int = 0, world: int = 1):
        self.staged, self.datasets, self.tokenizer, self.config = staged, datasets, tokenizer, config
        self.live, self.shard, self.rank, self.world = live, shard, rank, world
        self.mode = config.pre_inference.mode
        self.root = location(config.pre_inference.store_dir or RunDir(config.run.out).stores)
        settings = config.pre_inference  # checked here, before the run directory is made
        if self.root.exists() and not self.root.is_dir():
            raise UsageError(f"--store-dir {self.root} is a file, not a directory")
        self.device = next(p for p in staged.model.parameters() if not p.is_meta).device
        self.options = CacheOptions(store_format=settings.store_format, store_dtype=settings.store_dtype,
                                    samples_per_shard=shard, mode="overwrite", progress=False,
                                    model_name=config.model.name, dask=settings.dask,
                                    out_flag="--store-dir")  # a job of this rank alone
        # the stores the run trains from: under data parallelism every rank makes its share of each
        self.store_options = self.options if world == 1 else dataclasses.replace(
            self.options, part=Part(rank, world, dist.barrier))
        self.stores: dict[int, Location] = {}  # boundary -> cache directory believed valid
        self.emit: Callable[[Record], None] = lambda record: None
        self.rates: Throughputs | None = None  # measured in this run (the layer forward on first use)
        self.tally = Tally()
        self.assumed: Throughputs | None = None  # what the plan in force assumed
        self.blocks: list[Block] = []  # the sweep's visits, in order
        self.position = 0  # the next visit of the sweep
        self.plan: Plan | None = None  # covers the sweep's visits from `self.first`
        self.first = 0
        self.work: Workload | None = None
        self.sweep = -1
        self.said_no_reuse = False
        self.read_measured = False
        self.visit_started = 0.0
        self.sweep_times = [0.0, 0.0]  # predicted, measured
        self.run_times = [0.0, 0.0]

    def attach(self, emit: Callable[[Record], None]) -> None:
        self.emit = emit

    def sweep_started(self, blocks: list[Block]) -> None:
        """Plan the sweep."""
        self.sweep += 1
        self.blocks, self.position, self.sweep_times = list(blocks), 0, [0.0, 0.0]
        self._plan("sweep start")

    def sources(self, block: Block) -> tuple[BatchSource, BatchSource]:
        if self.position >= len(self.blocks) or self.blocks[self.position].index != block.index:
            self.blocks, self.position = [block], 0  # resumed mid-sweep: the rest of the order is unknown here
            self.sweep = max(self.sweep, 0)
            self._plan("resumed mid-sweep")
        self._make_stores()
        slot = self.position - self.first
        self._delete_unread(2 * slot)
        boundary = self.plan.sources[slot]
        self._log_visit(block, boundary)
        if boundary:
            started = time.perf_counter()
            path = self._ensure(boundary)  # checked again: a stale store is made anew
            self._count(0.0, time.perf_counter() - started)
        self.visit_started = time.perf_counter()
        if not boundary:
            return self.live.train, self.live.eval
        stores = open_cache(path, splits=["train", "eval"])
        batch, seed = self.config.data.batch_size, self.config.run.seed
        return (ReaderBatches(stores["train"], boundary, batch, seed, self.rank, self.world),
                ReaderBatches(stores["eval"], boundary, batch, seed, shuffle=False))

    def visit_finished(self, block: Block) -> None:
        """Time the visit, drop the stores it made stale (those above its first layer) and those the plan reads no
        more; re-plan the rest of the sweep if the throughputs moved; at the sweep's end, log predicted against
        measured time."""
        measured = time.perf_counter() - self.visit_started
        slot = self.position - self.first
        visit, boundary = self.work.visits[slot], self.plan.sources[slot]
        self._count(self.plan.visit_seconds[slot], measured)
        self._measure_steps(visit, boundary, measured)
        for stale in [b for b in self.stores if b > block.start]:
            self._delete(stale, reason=f"block {block.index} changed layers below it")
        self._delete_unread(2 * slot + 1)
        self.position += 1
        if self.position == len(self.blocks):
            predicted, spent = self.sweep_times
            self.emit(PlanOutcomeRecord(sweep=self.sweep, predicted_s=predicted, measured_s=spent,
                                        run_predicted_s=self.run_times[0], run_measured_s=self.run_times[1]))
            return
        self._revise_if_moved()

    def _make_stores(self) -> None:
        """Make the stores the plan makes before this visit, one at a time; each one measures the throughputs, and
        when they moved the rest of the sweep is planned again before the next."""
        while todo := [b for b in self.plan.builds if b.slot == self.position - self.first and
                       b.boundary not in self.stores]:
            build = todo[0]
            started = time.perf_counter()
            self._ensure(build.boundary, build.source)
            measured = time.perf_counter() - started
            self._count(build.seconds, measured)
            below = [build.source] if build.source else []
            variable = store_cost(self.work, dataclasses.replace(self.rates, store_overhead_s=0.0), build.boundary,
                                  below)[1]
            self.tally.builds += 1
            self._add_overhead(max(measured - variable, 0.0))
            self._revise_if_moved()

    def _add_overhead(self, seconds: float) -> None:
        """A store's fixed cost: its build beyond its forward and bytes, and its deletion."""
        self.tally.overhead_seconds += seconds
        if self.tally.builds:
            self.rates = dataclasses.replace(self.rates,
                                             store_overhead_s=self.tally.overhead_seconds / self.tally.builds)

    def _revise_if_moved(self) -> None:
        self.rates = self._agreed(self.rates)
        moved = self.rates.differs(self.assumed)
        if moved:
            self._plan("revised: " + ", ".join(f"{name} {getattr(self.assumed, name):.3g} -> "
                                               f"{getattr(self.rates, name):.3g}" for name in moved))

    # ---- plans -------------------------------------------------------------------------------------------------
    def _plan(self, reason: str) -> None:
        """Plan the sweep's remaining visits with the stores valid now and the throughputs measured so far."""
        self.work = self._workload(self.blocks[self.position:])
        if self.rates is None:
            self.rates = self._agreed(Throughputs(self._layer_seconds(), ASSUMED_WRITE_BPS, ASSUMED_READ_BPS,
                                                  ASSUMED_STORE_OVERHEAD_S))
            if self.mode == "auto" and self._stores_could_pay():
                self._probe_store()
        self.rates = self._agreed(self.rates)
        chosen = plan_sweep(self.work, self.rates, self.mode)
        self.plan, self.first, self.assumed = chosen.chosen, self.position, self.rates
        self.emit(self._plan_record(chosen, reason))

    def _plan_record(self, chosen: SweepPlan, reason: str) -> SweepPlanRecord:
        plan, alternative = chosen.chosen, chosen.alternative
        note = None
        if chosen.no_reuse and not plan.reads_stores and not self.said_no_reuse:
            self.said_no_reuse = True
            note = (f"pre-inference: the {self.config.blocks.order} order gives stores no reuse (every visit "
                    f"changes the layers below the next one's store, so each store would serve one visit only); "
                    f"training live")
        return SweepPlanRecord(
            sweep=self.sweep, reason=reason, mode=self.mode, first_visit=self.position, chosen=plan.describe(),
            predicted_s=plan.seconds,
            alternative=alternative.describe() if alternative is not None else "none fits the disk" if any(
                v.start > 0 for v in self.work.visits) else "none: no visit starts above the input",
            alternative_s=None if alternative is None else alternative.seconds, live_s=chosen.live.seconds,
            sources=list(plan.sources),
            builds=[{"boundary": b.boundary, "from": b.source, "before_visit": self.position + b.slot,
                     "seconds": b.seconds} for b in plan.builds],
            peak_bytes=plan.peak_bytes, free_bytes=self.work.free_bytes, layer_seconds=self.rates.layer_seconds,
            write_bps=self.rates.write_bps, read_bps=self.rates.read_bps,
            store_overhead_s=self.rates.store_overhead_s, note=note)

    def _log_visit(self, block: Block, boundary: int) -> None:
        """One visit's part of the plan (a `pre_inference` record); nothing for a block that reads the input."""
        if block.start == 0:
            return
        work, rates, slot = self.work, self.rates, self.position - self.first
        visit = work.visits[slot]
        build = next((b for b in self.plan.builds if b.boundary == block.start), None)
        if build is not None:
            source, build_s = build.source, build.seconds
        elif boundary:  # reused
            source, build_s = 0, 0.0
        else:  # what its store would cost now
            source, build_s = store_cost(work, rates, block.start, [k for k in work.stores if k < block.start])
        read = work.sample_bytes / rates.read_bps
        saving = visit_seconds(work, rates, visit, 0) - visit_seconds(work, rates, visit, block.start) - build_s
        self.emit(PreInferenceRecord(
            block=block.index, boundary=block.start, decision="store" if boundary else "live", steps=visit.steps,
            prefix_per_step=block.start * rates.layer_seconds * work.samples_per_step,
            read_per_step=work.samples_per_step * read, eval_prefix=work.eval_samples * (
                block.start * rates.layer_seconds - read), build=build_s,
            build_from=source, store_bytes=work.store_bytes,
            free_bytes=work.free_bytes, saving_s=saving))

    def _workload(self, blocks: list[Block]) -> Workload:
        train, cfg = self.datasets["train"], self.config
        samples_per_step = cfg.data.batch_size * cfg.optim.grad_accum
        steps_per_epoch = -(-len(train) // (cfg.data.batch_size * self.world * cfg.optim.grad_accum))
        steps = step_budget(cfg.stop, steps_per_epoch) or steps_per_epoch  # as the visit's stopping rule counts
        eval_samples = len(self.datasets["eval"])  # capped by --eval-tokens
        return Workload(
            visits=tuple(Visit(block=b.index, start=b.start, steps=steps) for b in blocks),
            num_layers=self.staged.num_layers, samples_per_step=samples_per_step, train_samples=len(train),
            eval_split_samples=len(self.datasets["eval"]), eval_samples=eval_samples,
            sample_bytes=train.seq_len * bytes_per_token(cfg.pre_inference.store_dtype, self.staged.hidden_size,
                                                         self.staged.compute_dtype),
            free_bytes=self._least(math.inf if (free := free_bytes(self.root)) is None else free),  # inf: no limit
            stores=frozenset(self._valid_stores()), ranks=self.world,
        )

    # ---- measurements ------------------------------------------------------------------------------------------
    def _count(self, predicted: float, measured: float) -> None:
        for times in (self.sweep_times, self.run_times):
            times[0] += predicted
            times[1] += measured

    def _measure_steps(self, visit: Visit, boundary: int, measured: float) -> None:
        """A visit's own step time: its wall time less what the plan charges for its input and its evaluation."""
        if visit.steps <= 0:
            return
        steps = {**self.rates.step_seconds, visit.block: 0.0}
        rest = visit_seconds(self.work, dataclasses.replace(self.rates, step_seconds=steps), visit, boundary)
        steps[visit.block] = max(measured - rest, 0.0) / visit.steps
        self.rates = dataclasses.replace(self.rates, step_seconds=steps)

    def _measure_build(self, result: CacheResult, source: int) -> None:
        """The layer forward and write speed over every store made so far, the one just made included."""
        tally = self.tally
        tally.forward_seconds += result.forward_seconds
        tally.layer_samples += (result.boundary - source) * result.samples_computed
        tally.write_seconds += result.write_seconds
        tally.write_bytes += result.samples_computed * self.work.sample_bytes  # the cost model's bytes: uncompressed
        self.rates = dataclasses.replace(
            self.rates,
            layer_seconds=tally.forward_seconds / tally.layer_samples if tally.forward_seconds else
            self.rates.layer_seconds,
            write_bps=tally.write_bytes / tally.write_seconds if tally.write_seconds > 0 else self.rates.write_bps)

    def _measure_read(self, path: Location, split: str = "eval") -> None:
        """Read speed: one pass over a store's split (the probe's, then the first store's eval split)."""
        store = open_cache(path, splits=[split])[split]
        started = time.perf_counter()
        samples = sum(len(batch["hidden"]) for batch in store.reader(self.config.data.batch_size, shuffle=False))
        seconds = time.perf_counter() - started
        if seconds > 0 and samples:
            sample_bytes = self.work.sample_bytes
            self.rates = dataclasses.replace(self.rates, read_bps=samples * sample_bytes / seconds)

    def _stores_could_pay(self) -> bool:
        """Whether stores could save more than the probe costs (`PROBE_COST_S`) beyond `STORE_MARGIN` on a disk
        that costs nothing to write and read, each store still costing its fixed overhead (if not, timing the disk
        cannot pay for itself, and the probe is not made)."""
        free = plan_sweep(self.work, dataclasses.replace(self.rates, write_bps=math.inf, read_bps=math.inf), "auto")
        return free.best_store is not None and (
            free.best_store.seconds + PROBE_COST_S < (1 - sweep_plan.STORE_MARGIN) * free.live.seconds)

    def _probe_store(self) -> None:
        """The first estimate of the write and read speeds and of a store's fixed cost: the store at boundary 1 of
        the first training samples (one shard, at most `PROBE_BYTES`), made by the caching job's code where the
        stores will go, read back once and deleted. The first real store replaces the estimates (`Tally`,
        `_measure_read`)."""
        started = time.perf_counter()
        train = self.datasets["train"]
        samples = max(1, min(self.shard, len(train), PROBE_BYTES // self.work.sample_bytes))
        out = self.root / f"probe-rank{self.rank}"  # each rank times its own writes
        try:
            result = cache_boundary(self.staged, {"probe": train.head(samples)}, self.tokenizer, 1, out,
                                    self.options)
            if result.write_seconds > 0:
                self.rates = dataclasses.replace(self.rates,
                                                 write_bps=samples * self.work.sample_bytes / result.write_seconds)
            self._measure_read(out, "probe")
        finally:
            deleting = time.perf_counter()
            remove_tree(out)
        # the store's fixed cost (open, check, finalize, index, delete) until the first real store measures it
        overhead = result.seconds - result.forward_seconds - result.write_seconds + time.perf_counter() - deleting
        self.rates = dataclasses.replace(self.rates, store_overhead_s=max(overhead, 0.0))
        self.emit(CacheRecord(boundary=1, how="probe", seconds=time.perf_counter() - started,
                              bytes=result.bytes_written))

    @torch.no_grad()
    def _layer_seconds(self) -> float:
        """Median time of one layer's no_grad forward over one sample, measured once on a training batch (after
        one untimed forward: the first allocates)."""
        batch = self.datasets["train"][: self.config.data.batch_size]
        device = next(p for p in self.staged.model.parameters() if not p.is_meta).device
        state = self.staged.embed(*(batch[k].to(device) for k in ("input_ids", "attention_mask", "labels")))
        self.staged.run(state, 0, 1)
        times = []
        for _ in range(LAYER_PROBES):
            started = time.perf_counter()
            self.staged.run(state, 0, 1)
            times.append(time.perf_counter() - started)
        return statistics.median(times) / len(batch["input_ids"])

    # ---- ranks (data parallelism) ------------------------------------------------------------------------------
    def _agreed(self, rates: Throughputs) -> Throughputs:
        return rates if self.world == 1 else slowest(rates, self.device)

    def _least(self, value: float) -> float:
        """The smallest of every rank's `value` (the free disk: the ranks may write to disks of their own)."""
        return value if self.world == 1 else _all_reduce([value], dist.ReduceOp.MIN, self.device)[0]

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

    def _ensure(self, boundary: int, source: int | None = None) -> Location:
        """A valid store at `boundary`: reused, or made from `source` (0: the input) if that is still valid, else
        rolled forward from the nearest valid lower one, or made from the input."""
        if boundary in self.stores and self._is_valid(boundary):
            self.emit(CacheRecord(boundary=boundary, how="reuse", seconds=0.0, bytes=0))
            return self.stores[boundary]
        out = self.root / f"boundary-{boundary}"
        valid = [b for b in self._valid_stores() if b < boundary]
        if source not in (0, *valid):
            source = max(valid, default=0)
        if source:
            result = roll_forward(self.staged, self.stores[source], boundary, out, self.store_options)
        else:
            result = cache_boundary(self.staged, self.datasets, self.tokenizer, boundary, out, self.store_options)
        self.stores[boundary] = out
        self.emit(CacheRecord(boundary=boundary, how="roll_forward" if source else "input", from_=source,
                              seconds=result.seconds, bytes=result.stored_bytes))
        self._measure_build(result, source)
        if not self.read_measured:
            self._measure_read(out)
            self.read_measured = True
        return out

    def _delete_unread(self, now: int) -> None:
        """Delete the stores the plan reads no more after event `now` (see `sweep_plan.Plan`)."""
        last_use = dict(self.plan.deletes)
        for boundary in [b for b in self.stores if last_use.get(b, -1) <= now]:
            self._delete(boundary, reason="the plan reads it no more")

    def _delete(self, boundary: int, reason: str) -> None:
        path = self.stores.pop(boundary)
        if not self.config.pre_inference.keep_stores:
            if self.world > 1:
                dist.barrier()  # no rank reads it any more
            started = time.perf_counter()
            if self.rank == 0:
                remove_tree(path)
            seconds = time.perf_counter() - started
            self._add_overhead(seconds)
            self.emit(CacheRecord(boundary=boundary, how="deleted", reason=reason, seconds=seconds, bytes=0))


def slowest(rates: Throughputs, device: torch.device) -> Throughputs:
    """Under data parallelism, the throughputs every rank plans with: the slowest rank's (a step waits for every
    rank), so that all ranks make the same plans and build and read the same stores."""
    blocks = sorted(rates.step_seconds)  # the same visits on every rank
    values = [rates.layer_seconds, _inverse(rates.write_bps), _inverse(rates.read_bps), rates.store_overhead_s,
              *(rates.step_seconds[b] for b in blocks)]
    layer, write, read, overhead, *steps = _all_reduce(values, dist.ReduceOp.MAX, device)
    return Throughputs(layer, _inverse(write), _inverse(read), overhead, dict(zip(blocks, steps)))


def _all_reduce(values: list[float], op: dist.ReduceOp, device: torch.device) -> list[float]:
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=op)
    return tensor.tolist()


def _inverse(value: float) -> float:
    """1 / value, with 1 / 0 = inf and 1 / inf = 0 (speeds of storage that costs nothing)."""
    return math.inf if value == 0 else 1 / value
