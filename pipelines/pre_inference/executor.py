"""The executor of pre-inference inside a BCD run: at the start of every sweep it plans the sweep
(`sweep_plan.plan_sweep`), then follows the plan visit by visit: makes the stores the plan makes before each visit,
hands each visit its batches (from a store, or live), and after each visit drops the stores it made stale or the
plan reads no more, and plans the rest of the sweep again when the throughputs moved."""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable

from preinfer.batch_source import BatchSource
from preinfer.config import Config
from preinfer.metrics import PlanOutcomeRecord, PreInferenceRecord, Record, SweepPlanRecord
from preinfer.optim import step_budget
from preinfer.partition import Block
from preinfer.run_dir import RunDir
from preinfer.staged import StagedModel
from storage import Location, free_bytes, location
from pipelines.cache import CacheOptions, bytes_per_token, open_cache
from pipelines.data.batches import ReaderBatches
from pipelines.pre_inference import probe
from pipelines.pre_inference.ranks import least
from pipelines.pre_inference.rates import MeasuredRates
from pipelines.pre_inference.stores import Stores, check_store_dir
from pipelines.pre_inference.writers import LocalWriter, StoreWriter
from pipelines.pre_inference.sweep_plan import (
    Plan, SweepPlan, Throughputs, Visit, Workload, plan_sweep, store_cost, switch_seconds, visit_seconds,
)


class PreInference:
    """A `preinfer.batch_source.VisitSources` that trains blocks above the input from stores (mode `on` or `auto`).

    `rank` of `world`: the processes that take every decision together (they agree on the throughputs and the free
    disk, so that all follow the same plans); `writer`: how they make a store (default `LocalWriter`: the whole model
    in each process, each data-parallel rank its share); `replica` of `replicas`: this process's share of the
    training samples (default: `rank` of `world`). A pipeline gives its stages' writer (`auto` does not run there:
    its disk probe needs the whole model)."""

    def __init__(self, staged: StagedModel, datasets: dict, tokenizer, config: Config, live, shard: int,
                 rank: int = 0, world: int = 1, *, writer: StoreWriter | None = None, replica: int | None = None,
                 replicas: int | None = None):
        self.staged, self.datasets, self.tokenizer, self.config = staged, datasets, tokenizer, config
        self.live, self.shard, self.rank, self.world = live, shard, rank, world
        self.writer = writer or LocalWriter(staged, datasets, tokenizer, rank, world)
        self.replica = rank if replica is None else replica
        self.replicas = world if replicas is None else replicas
        self.mode = config.pre_inference.mode
        self.root = location(config.pre_inference.store_dir or RunDir(config.run.out).stores)
        check_store_dir(self.root)
        settings = config.pre_inference  # checked here, before the run directory is made
        self.device = next(p for p in staged.model.parameters() if not p.is_meta).device
        self.options = CacheOptions(store_format=settings.store_format, store_dtype=settings.store_dtype,
                                    samples_per_shard=shard, mode="overwrite", progress=False,
                                    model_name=config.model.name, dask=settings.dask,
                                    out_flag="--store-dir")  # a job of this process alone (the writer shares it)
        self.emit: Callable[[Record], None] = lambda record: None
        self.stores = Stores(staged, datasets, tokenizer, config, self.root, self.options,
                             lambda record: self.emit(record), self.writer, rank, world)
        self.rates = MeasuredRates(world, self.device)  # measured in this run (the layer forward on first use)
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
            self.writer.reading(block, boundary)
        self.visit_started = time.perf_counter()
        if not boundary:
            return self.live.train, self.live.eval
        stores = open_cache(path, splits=["train", "eval"])
        batch, seed = self.config.data.batch_size, self.config.run.seed
        return (ReaderBatches(stores["train"], boundary, batch, seed, self.replica, self.replicas),
                ReaderBatches(stores["eval"], boundary, batch, seed, shuffle=False))

    def measure_source(self) -> BatchSource:
        return self.live.train

    def switch_seconds(self, block: Block) -> float:
        """`sweep_plan.switch_seconds` of a visit of `block`, by the plan in force and the throughputs measured."""
        visit = Visit(block=block.index, start=block.start, steps=self._visit_steps())
        return switch_seconds(self.work, self.rates.current, visit, self.plan.reads_stores, self.writer.rolls_forward)

    def visit_finished(self, block: Block) -> None:
        """Time the visit, drop the stores it made stale (those above its first layer) and those the plan reads no
        more; re-plan the rest of the sweep if the throughputs moved; at the sweep's end, log predicted against
        measured time."""
        measured = time.perf_counter() - self.visit_started
        slot = self.position - self.first
        visit, boundary = self.work.visits[slot], self.plan.sources[slot]
        self._count(self.plan.visit_seconds[slot], measured)
        self.rates.add_steps(self.work, visit, boundary, measured)
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

    def close(self) -> None:
        """At the end of the run: delete the stores left (by a run stopped mid-sweep), unless --keep-stores."""
        for boundary in list(self.stores):
            self._delete(boundary, reason="the run is over")

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
            variable = store_cost(self.work, dataclasses.replace(self.rates.current, store_overhead_s=0.0),
                                  build.boundary, below)[1]
            self.rates.add_overhead(max(measured - variable, 0.0), built=True)
            self._revise_if_moved()

    def _revise_if_moved(self) -> None:
        rates = self.rates.agree()
        moved = rates.differs(self.assumed)
        if moved:
            self._plan("revised: " + ", ".join(f"{name} {getattr(self.assumed, name):.3g} -> "
                                               f"{getattr(rates, name):.3g}" for name in moved))

    # ---- plans -------------------------------------------------------------------------------------------------
    def _plan(self, reason: str) -> None:
        """Plan the sweep's remaining visits with the stores valid now and the throughputs measured so far."""
        self.work = self._workload(self.blocks[self.position:])
        if self.rates.current is None:
            self.rates.current = probe.first_estimate(self.staged,
                                                      self.datasets["train"][: self.config.data.batch_size])
            self.rates.agree()
            if self.mode == "auto" and probe.stores_could_pay(self.work, self.rates.current, self.shard):
                self._probe_store()
        rates = self.rates.agree()
        chosen = plan_sweep(self.work, rates, self.mode, self.writer.rolls_forward)
        self.plan, self.first, self.assumed = chosen.chosen, self.position, rates
        self.emit(self._plan_record(chosen, reason))

    def _plan_record(self, chosen: SweepPlan, reason: str) -> SweepPlanRecord:
        plan, alternative, rates = chosen.chosen, chosen.alternative, self.rates.current
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
            peak_bytes=plan.peak_bytes, free_bytes=self.work.free_bytes, layer_seconds=rates.layer_seconds,
            write_bps=rates.write_bps, read_bps=rates.read_bps, store_overhead_s=rates.store_overhead_s, note=note,
            build_layer_seconds=rates.build_layer_seconds)

    def _log_visit(self, block: Block, boundary: int) -> None:
        """One visit's part of the plan (a `pre_inference` record); nothing for a block that reads the input."""
        if block.start == 0:
            return
        work, rates, slot = self.work, self.rates.current, self.position - self.first
        visit = work.visits[slot]
        build = next((b for b in self.plan.builds if b.boundary == block.start), None)
        if build is not None:
            source, build_s = build.source, build.seconds
        elif boundary:  # reused
            source, build_s = 0, 0.0
        else:  # what its store would cost now
            source, build_s = store_cost(work, rates, block.start,
                                         [k for k in work.stores if k < block.start and self.writer.rolls_forward])
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
        steps = self._visit_steps()
        eval_samples = len(self.datasets["eval"])  # capped by --eval-tokens
        return Workload(
            visits=tuple(Visit(block=b.index, start=b.start, steps=steps) for b in blocks),
            num_layers=self.staged.num_layers, samples_per_step=samples_per_step, train_samples=len(train),
            eval_split_samples=len(self.datasets["eval"]), eval_samples=eval_samples,
            sample_bytes=train.seq_len * bytes_per_token(cfg.pre_inference.store_dtype, self.staged.hidden_size,
                                                         self.staged.compute_dtype),
            free_bytes=least(math.inf if (free := free_bytes(self.root)) is None else free,  # inf: no limit
                             self.world, self.device),
            stores=frozenset(self.stores.valid()), ranks=self.writer.parts,
        )

    def _visit_steps(self) -> int:
        """A visit's expected steps, as its stopping rule counts them."""
        cfg = self.config
        per_step = cfg.data.batch_size * self.replicas * cfg.optim.grad_accum
        steps_per_epoch = -(-len(self.datasets["train"]) // per_step)
        return step_budget(cfg.stop, steps_per_epoch) or steps_per_epoch

    # ---- measurements ------------------------------------------------------------------------------------------
    def _count(self, predicted: float, measured: float) -> None:
        for times in (self.sweep_times, self.run_times):
            times[0] += predicted
            times[1] += measured

    def _probe_store(self) -> None:
        """The first estimate of the disk (`probe.probe_store`), where the stores will go; each rank times its own
        writes."""
        rates, record = probe.probe_store(self.staged, self.datasets["train"], self.tokenizer,
                                          self.root / f"probe-rank{self.rank}", self.options, self.shard,
                                          self.config.data.batch_size, self.work.sample_bytes, self.rates.current)
        self.rates.current = rates
        self.emit(record)

    # ---- stores ------------------------------------------------------------------------------------------------
    def _ensure(self, boundary: int, source: int | None = None) -> Location:
        """A valid store at `boundary` (`Stores.ensure`); one made here measures the throughputs, and the first
        one made the read speed too."""
        path, built, source = self.stores.ensure(boundary, source)
        if built is not None:
            self.rates.add_build(built, source, self.work.sample_bytes)
            if not self.read_measured:
                self.rates.add_read(path, "eval", self.config.data.batch_size, self.work.sample_bytes)
                self.read_measured = True
        return path

    def _delete_unread(self, now: int) -> None:
        """Delete the stores the plan reads no more after event `now` (see `sweep_plan.Plan`)."""
        last_use = dict(self.plan.deletes)
        for boundary in [b for b in self.stores if last_use.get(b, -1) <= now]:
            self._delete(boundary, reason="the plan reads it no more")

    def _delete(self, boundary: int, reason: str) -> None:
        if (seconds := self.stores.delete(boundary, reason)) is not None:
            self.rates.add_overhead(seconds)
