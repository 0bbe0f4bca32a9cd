"""The BCD trainer: sweeps of visits; each visit trains one block while every other parameter stays frozen.

`Trainer.fit` is the visit loop: for each sweep (`preinfer.sweeps`: its order, importance measurements, the gain
rule and the step budget) and each of its visits, activate the block, step it until its stopping rule fires
(`preinfer.visit.VisitLifecycle`: one step, through the step's seams), deactivate it, evaluate
(`Seams.eval_sums`) and record the visit. Where the model lives (one process, data-parallel replicas, a
pipeline stage) is the `Seams` the trainer is given (`preinfer.seams`); the optimizer lifecycle (masters,
clipping, loss scaling, the schedule, kept states) is `preinfer.visit_optimizer`'s, shared with `preinfer.hf`.

Precision (`preinfer.precision`): under mixed precision the optimizer steps fp32 masters of the active block,
which exist for its visit only, and the masters are cast into the 16-bit weights after every step.

Stopping: a caller (the CLI's signal handler) sets `stop_requested`; the trainer checks it between steps, writes
a checkpoint and returns from `fit` with `stopped` set. A resumed run then ends with the same weights as an
uninterrupted one. `--total-steps` ends the run at that step, mid-visit and mid-sweep (the visit is evaluated
and recorded as any other).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from pathlib import Path

import torch

from preinfer.batch_source import BatchSource, VisitSources
from preinfer.checkpoint import STATE
from preinfer.config import Config
from preinfer.errors import DivergedError, PreinferError, UsageError
from preinfer.evaluation import eval_mode
from preinfer.config.resolved import check_resolved
from preinfer.expansion import expansion_hooks, expansion_of, widest_rank
from preinfer.frozen_weights import frozen_weight_hooks
from preinfer.parallel_dims import parallel_dims
from preinfer.seams import Seams, replica_seams
from preinfer.metrics import MetricsLog, Record
from preinfer.moe import ExpertGranular, sparse_blocks
from preinfer.optim import StopRule
from preinfer.partition import Block, Partition
from preinfer.precision import LossScaler, Precision, apply_precision
from preinfer.run_dir import RunDir
from preinfer.run_position import RunPosition
from preinfer.staged import StagedModel
from preinfer.stream_frozen import stream_frozen_hooks
from preinfer.sweeps import Sweeps
from preinfer.visit import VisitLifecycle
from preinfer.visit_optimizer import VisitOptimizer, VisitOptimizers


class Trainer:
    def __init__(
        self,
        staged: StagedModel,
        partition: Partition,
        config: Config,
        sources: VisitSources,
        run_dir: RunDir | None = None,
        meter=None,
        on_record: Callable[[Record], None] | None = None,
        active_block: int | None = None,
        clock: Callable[[], float] = time.perf_counter,
        seams: Seams | None = None,
        precision: Precision | None = None,
    ):
        """`seams`: where the model lives (default: one process, or a data-parallel replica under torchrun);
        `precision`: the run's, resolved and applied to the model (default: `run.precision` resolved and applied
        here)."""
        self.staged, self.partition, self.config, self.visit_sources = staged, partition, config, sources
        self.run_dir, self.on_record = run_dir, on_record
        if seams is None:
            seams = replica_seams(staged, config, parallel_dims(1, config.run.device))
        self.seams = seams
        self.rank, self.world_size = self.seams.rank, self.seams.world_size
        self.log = MetricsLog(run_dir.metrics if run_dir and self.rank == 0 else None)
        self.position = RunPosition()
        self.wall_s = 0.0  # time spent in fit()
        self.precision = precision if precision is not None else apply_precision(staged.model, config.run.precision)
        check_resolved(config, self.precision, blocks=len(partition),  # direct callers too: the resolved run
                       sparse=bool(sparse_blocks(staged.layers)), widest=widest_rank(staged))
        staged.use_loss(config.run.loss, config.run.loss_chunk)
        staged.offload = config.run.offload
        self.optimizers = VisitOptimizers(config.optim, self.precision, torch.device(config.run.device).type,
                                          len(partition))
        self.visit: VisitOptimizer | None = None  # the visit's optimizer and masters; None between visits
        self.saved_masters: list[torch.Tensor] = []  # from a mid-visit checkpoint, for the visit it resumes
        self.stop_requested = False  # set from outside (a signal handler): checkpoint and stop after this step
        self.stopped = False  # fit() returned because stop_requested was set
        b = config.blocks
        self.experts = ExpertGranular(staged, b.experts, b.experts_with, b.experts_sample)
        if b.experts and self.world_size > 1:
            raise UsageError(f"{config.naming.value('blocks', 'experts', b.experts)}: expert-granular blocks run in "
                             f"one process; drop it, or torchrun with {config.naming.key('run', 'pipeline')}")
        self.sweeps = Sweeps(staged, partition, config, sources, self.scaler, clock, self.emit,
                             lambda: self.checkpoint_dir / STATE, active_block, self.world_size)
        streamed = stream_frozen_hooks(staged, config, self.seams)  # first: each layer's codes leave as made
        frozen = frozen_weight_hooks(staged, config, streamed[0].stream.evict if streamed else None)
        self.lifecycle = VisitLifecycle(staged, config, self.seams, self.optimizers, self.experts, meter,
                                        hooks=[*frozen, *streamed,
                                               *expansion_hooks(staged, config, lambda: self.position.global_step,
                                                                self.seams.sum_over_replicas)])
        self.expand = expansion_of(staged, config)  # the run's landscape expansion, auto resolved
        sources.attach(self.emit)

    @property
    def meter(self):
        """The memory meter tracking the first steps of each visit (None: none)."""
        return self.lifecycle.meter

    @meter.setter
    def meter(self, meter) -> None:
        self.lifecycle.meter = meter

    @property
    def scaler(self) -> LossScaler:
        """The run's loss scaler (fp16-mixed; disabled otherwise)."""
        return self.optimizers.scaler

    def emit(self, record: Record) -> None:
        self.log.write(record)
        if self.on_record is not None:
            self.on_record(record)

    @property
    def checkpoint_dir(self) -> Path:
        """The directory of this process's checkpoint."""
        if self.run_dir is None:
            raise PreinferError("this trainer has no run directory to checkpoint into")
        return self.seams.checkpoint_dir(self.run_dir)

    def resume(self) -> None:
        """Continue from the run directory's checkpoint."""
        state_file = self.checkpoint_dir / STATE  # (refuses a trainer without a run directory)
        checkpoint = self.seams.load(self.run_dir, self.staged.model)
        self.optimizers.kept = checkpoint.optimizers
        self.position = RunPosition.from_state(checkpoint.trainer, str(state_file),
                                               self.config.blocks.sweeps, self.sweeps.visits_per_sweep())
        self.saved_masters = checkpoint.masters
        if self.scaler.enabled and self.position.loss_scaler is not None:
            self.scaler.load_state_dict(self.position.loss_scaler)

    def fit(self, max_total_steps: int | None = None) -> list[dict]:
        """Run every remaining visit; stop early (after a checkpoint) once `max_total_steps` steps are done or
        when `stop_requested` is set."""
        try:
            return self._fit(max_total_steps)
        finally:
            self.log.close()

    def _fit(self, max_total_steps: int | None) -> list[dict]:
        p = self.position
        while p.sweep < self.config.blocks.sweeps and not self.sweeps.budget_ends_before_visit(p):
            order = self.sweeps.order(p.sweep, p)
            if p.visit == 0:
                self.visit_sources.sweep_started([self.partition.blocks[i] for i in order])
            while p.visit < len(order):
                if self.sweeps.budget_ends_before_visit(p):
                    return p.visits
                block = self.partition.blocks[order[p.visit]]
                if not self._visit(block, max_total_steps, order) or p.visits[-1]["stop_reason"] == "total-steps":
                    return p.visits  # a visit cut by --total-steps keeps its mid-visit checkpoint (`_visit`)
                p.visit += 1
                p.visit_step, p.stop, p.gain = 0, None, None
                self._checkpoint(self.optimizers.states())
            p.sweep, p.visit = p.sweep + 1, 0
        return p.visits

    def _visit(self, block: Block, max_total_steps: int | None, order: list[int] = ()) -> bool:
        """Train `block` (visit `position.visit` of the sweep's `order`) until its stopping rule fires; False if the
        run was halted by `max_total_steps` or a stop request."""
        p, cfg = self.position, self.config
        train, evaluation = self.visit_sources.sources(block)
        if p.cursor is not None:
            train.load_state_dict(p.cursor)
        stop = StopRule.for_visit(cfg.stop, -(-train.batches_per_epoch // cfg.optim.grad_accum))
        if p.stop is not None:
            stop.load_state_dict(p.stop)
        masters, self.saved_masters = self.saved_masters or None, []
        self.visit = visit = self.lifecycle.activate(block, p, train, stop.max_steps, masters)
        gain = self.sweeps.gain_rule(block, order, stop.max_steps, p)
        if self.meter is not None:
            self.meter.reset()
        started = time.perf_counter()
        reason = "total-steps" if self.sweeps.steps_spent(p) else None  # resumed cut visit, the same budget
        while reason is None:
            halted = max_total_steps is not None and p.global_step >= max_total_steps
            if halted or self.seams.stop_agreed(self.stop_requested):
                self._save_visit_state(train, visit, block, stop)
                self.stopped = not halted
                return False
            visit.set_rate(p.visit_step)
            loss, tokens, timings = self.lifecycle.train_step(block, train, visit)
            if not math.isfinite(loss):
                raise DivergedError(f"training diverged: the loss is {loss} at step {p.global_step + 1} (sweep "
                                    f"{p.sweep}, block {block.index}); the run stopped, its last checkpoint kept; "
                                    f"start again with a lower --lr or with --grad-clip")
            p.visit_step += 1
            p.global_step += 1
            p.tokens += tokens
            reason = stop.update(loss)
            if gain is not None and gain.update(loss, self.sweeps.clock()) and reason is None:
                reason = "gain"
            if reason is None and self.sweeps.steps_spent(p):
                reason = "total-steps"
            p.stop = stop.state_dict()
            p.gain = gain.state_dict() if gain is not None else None
            p.cursor = train.state_dict()
            p.loss_scaler = self.scaler.state_dict() if self.scaler.enabled else None
            self.emit(p.step_record(block, loss, visit.lr, tokens, timings, started, self._step_fields()))
            every = cfg.run.checkpoint_every
            if reason == "total-steps" or (every and p.global_step % every == 0 and reason is None):
                self._save_visit_state(train, visit, block, stop)  # a raised budget continues a cut visit
        self.lifecycle.deactivate(block, visit, p)
        wall = time.perf_counter() - started  # the replicas' closing sync included
        self.visit = None
        evaluated = time.perf_counter()
        eval_loss = self.evaluate(evaluation)
        memory = self.optimizers.with_host_bytes(self.meter.report()) if self.meter is not None else {}
        record = p.visit_record(block, stop.steps, reason, eval_loss, wall, train.boundary, memory,
                                time.perf_counter() - evaluated, gain.report() if gain is not None else None,
                                visit.initial_lr, self.expansion(block))
        if self.seams.wire is not None:
            record.sent_bytes = self.seams.wire.take_visit()
        p.visits.append(record.to_dict())
        if self.meter is not None:
            record.ranks = self.seams.rank_memory(memory)
        self.emit(record)
        self.visit_sources.visit_finished(block)
        return True

    def expansion(self, block: Block) -> str | None:
        """The landscape expansion `block`'s visit makes of the layers above it; None: none."""
        return self.expand if self.expand != "none" and block.stop < len(self.staged.layers) else None

    def evaluate(self, source: BatchSource) -> float:
        """Mean next-token loss over every supervised token of the source's eval pass."""
        with eval_mode(self.staged.model):
            total, count = self.seams.eval_sums(source)
        return total / max(count, 1)

    def _step_fields(self) -> dict:
        """The step record's optional fields: data parallel, the bytes this rank sent in the step; fp16-mixed, the
        loss scale and skipped-step count."""
        fields = {} if self.seams.wire is None else {"sent_bytes": self.seams.wire.take_step()}
        if self.scaler.enabled:
            fields.update(loss_scale=self.scaler.scale, skipped_steps=self.scaler.skipped)
        return fields

    def _save_visit_state(self, train: BatchSource, visit: VisitOptimizer, block: Block, stop: StopRule) -> None:
        """Checkpoint mid-visit: the active block's optimizer state travels with the others."""
        self.position.cursor = train.state_dict()
        self.position.stop = stop.state_dict()
        self._checkpoint(self.optimizers.states(block.index, visit), self.lifecycle.checkpointed(visit))

    def _checkpoint(self, optimizers: dict[int, dict], masters: list[torch.Tensor] = ()) -> None:
        if self.run_dir is not None:
            self.seams.save(self.run_dir, self.staged.model, optimizers, vars(self.position), list(masters))
