"""The BCD trainer: sweeps of visits; each visit trains one block while every other parameter stays frozen.

One step (`train_step`): take `grad_accum` batches from the visit's source (token ids, or boundary states at some
boundary k), count their supervised tokens, run `forward_backward_step` over them, and step the active block's
optimizer. `forward_backward_step` is the one seam a subclass replaces (`PipelineTrainer` runs it over its
stages): here, per micro-batch, the frozen layers up to the active block run under `no_grad` (they save nothing
for backward), the active block and everything above it with autograd (with `run.recompute`, each of those
layers keeps only its input and runs again in backward). Backward stops at the active block because its input
carries no graph.

Precision (`preinfer.precision`): under mixed precision the optimizer steps fp32 masters of the active block,
which exist for its visit only, and the masters are cast into the 16-bit weights after every step. Under data
parallelism the active block's fp32 gradients are summed across ranks in flat buckets launched during backward
(`preinfer.grad_buckets`).

Orders: a fixed order (`preinfer.block_order.sweep_order`) is a function of the sweep; an importance order is
measured at the sweep's start (`preinfer.importance`, a forward and backward through every block over a few training
batches) and chosen by `block_order.importance_sweep`; the scores and the chosen visits are saved with the progress,
so a run resumed mid-sweep follows the same visits. `--stop gain` (`preinfer.gain`) ends a visit when another block
is predicted to lower the loss faster; its times come from `clock`. `--total-steps` ends the run at that step,
mid-visit and mid-sweep (the visit is evaluated and recorded as any other).

Stopping: a caller (the CLI's signal handler) sets `stop_requested`; the trainer checks it between steps, writes
a checkpoint and returns from `fit` with `stopped` set. A resumed run then ends with the same weights as an
uninterrupted one.
"""

from __future__ import annotations

import math
import time
from contextlib import contextmanager, nullcontext
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, fields
from pathlib import Path

import torch
import torch.distributed as dist

from preinfer.checkpoint import STATE, load_checkpoint, save_checkpoint
from preinfer.grad_buckets import BucketedAllReduce
from preinfer.config import Config
from preinfer.errors import CheckpointError, DivergedError, PreinferError, UsageError
from preinfer.gain import GainRule
from preinfer.importance import GradientSquares
from preinfer.metrics import ImportanceRecord, MetricsLog, Record, StepRecord, VisitRecord
from preinfer.moe import ExpertGranular, RouterLoss
from preinfer.optim import LrSchedule, StopRule, build_optimizer, step_budget
from preinfer.partition import Block, Partition
from preinfer.precision import ActiveBlock, LossScaler, apply_precision
from preinfer.run_dir import RunDir
from preinfer.block_order import IMPORTANCE_ORDERS, importance_sweep, parse_fixed_order, sweep_order
from preinfer.batch_source import BatchSource, VisitSources
from preinfer.staged import StagedModel, causal_lm_loss, supervised_tokens
from preinfer.boundary_state import BoundaryState


@dataclass
class Progress:
    """Where a run stands; saved in every checkpoint so that a resumed run continues bit for bit."""

    sweep: int = 0
    visit: int = 0  # index into the current sweep's order
    visit_step: int = 0
    global_step: int = 0
    tokens: int = 0
    cursor: dict | None = None  # the training source's state_dict; None: the start of the data
    stop: dict | None = None
    visits: list[dict] = field(default_factory=list)  # each finished visit's VisitRecord.to_dict()
    loss_scaler: dict | None = None  # fp16-mixed: the LossScaler's state (GradScaler's, and the skipped steps)
    experts: dict[str, dict[str, list[int]]] = field(default_factory=dict)  # block -> layer -> its chosen experts
    sweep_order: dict | None = None  # importance orders: the sweep's ImportanceRecord (scores, visits), as measured
    gain: dict | None = None  # --stop gain: the visit's GainRule state

    @classmethod
    def from_state(cls, state: object, source: str, sweeps: int, visits_per_sweep: int) -> Progress:
        """The progress a checkpoint saved, each field checked (its type, and the sweep and visit within the
        run's `sweeps` and `visits_per_sweep`); a bad one is a CheckpointError naming it."""
        if not isinstance(state, dict):
            raise CheckpointError(f"{source}: trainer: expected a JSON object, got {type(state).__name__}")
        known = {f.name for f in fields(cls)}
        for key, value in state.items():
            if key not in known:
                raise CheckpointError(f"{source}: trainer.{key}: not a field of the trainer's progress")
            kind, expected = PROGRESS_FIELDS[key]
            if not isinstance(value, kind) or isinstance(value, bool):
                raise CheckpointError(f"{source}: trainer.{key} = {value!r:.60}: expected {expected}")
        limits = {"sweep": sweeps, "visit": visits_per_sweep}
        for key in ("sweep", "visit", "visit_step", "global_step", "tokens"):
            value = state.get(key, 0)
            if not 0 <= value <= limits.get(key, value):
                bound = f" at most {limits[key]}" if key in limits else ""
                raise CheckpointError(f"{source}: trainer.{key} = {value}: expected an integer >= 0{bound}")
        return cls(**state)


# Each Progress field's JSON type, and how a message names it.
_DICT_OR_NONE = ((dict, type(None)), "an object or null")
PROGRESS_FIELDS = {
    **{key: (int, "an integer") for key in ("sweep", "visit", "visit_step", "global_step", "tokens")},
    "cursor": _DICT_OR_NONE, "stop": _DICT_OR_NONE, "loss_scaler": _DICT_OR_NONE, "sweep_order": _DICT_OR_NONE,
    "gain": _DICT_OR_NONE,
    "visits": (list, "a list of visit records"), "experts": (dict, "an object"),
}


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
    ):
        self.staged, self.partition, self.config, self.visit_sources = staged, partition, config, sources
        self.clock = clock  # the times of the gain rule and of the importance measurement (tests inject one)
        self.run_dir, self.meter, self.on_record = run_dir, meter, on_record
        self.device = torch.device(config.run.device)
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.world_size = dist.get_world_size() if dist.is_initialized() else 1
        self.log = MetricsLog(run_dir.metrics if run_dir and self.rank == 0 else None)
        self.fixed = parse_fixed_order(config.blocks.fixed_order, len(partition)) if config.blocks.fixed_order else None
        self.optimizer_states: dict[int, dict] = {}  # kept per block with optim.keep_state
        self.progress = Progress()
        self.active_block = active_block
        self.wall_s = 0.0  # time spent in fit()
        self.precision = apply_precision(staged.model, config.run.precision)
        self.scaler = LossScaler(self.device.type, enabled=self.precision == "fp16-mixed")
        self.active: ActiveBlock | None = None  # the visit's masters and gradients; None between visits
        self.saved_masters: list[torch.Tensor] = []  # from a mid-visit checkpoint, for the visit it resumes
        self.stop_requested = False  # set from outside (a signal handler): checkpoint and stop after this step
        self.stopped = False  # fit() returned because stop_requested was set
        self.reducer: BucketedAllReduce | None = None  # data parallelism: the active block's gradient buckets
        self.router_loss = RouterLoss(staged.model, staged.layers)
        b = config.blocks
        self.experts = ExpertGranular(staged, b.experts, b.experts_with, b.experts_sample)
        if b.experts and self.world_size > 1:
            raise UsageError("--experts (expert-granular blocks) runs in one process; drop it, or torchrun and "
                             "--pipeline")
        if b.experts and self.precision != "fp32":
            raise UsageError(f"--experts (expert-granular blocks) trains in fp32; drop it or --precision "
                                f"{self.precision}")
        self._check_order()  # a bad order, fixed order or start block is refused before anything runs
        LrSchedule.for_visit(config.optim, step_budget(config.stop, 1))  # and a decay without a visit length
        sources.attach(self.emit)

    def order(self, sweep: int) -> list[int]:
        """The blocks this sweep visits (with `active_block` set, only that one); an importance order's are measured
        here at the sweep's start, or taken from the progress when it holds this sweep's."""
        b = self.config.blocks
        if b.order in IMPORTANCE_ORDERS:
            return [self.active_block] if self.active_block is not None else self._importance_order(sweep)
        order = sweep_order(b.order, len(self.partition), sweep, self.config.run.seed, b.start_block, self.fixed)
        return [i for i in order if self.active_block is None or i == self.active_block]

    def _check_order(self) -> None:
        """Refuse a bad order, fixed order or start block, and what an importance order or the gain rule cannot
        run with."""
        b, rule = self.config.blocks, self.config.stop.rule
        if b.order not in IMPORTANCE_ORDERS:
            self.order(0)
            if rule == "gain":
                raise UsageError(f"--stop gain predicts other blocks' gains from their scores: it needs --order "
                                 f"importance or importance-cached (not {b.order})")
            return
        if b.start_block is not None:
            raise UsageError(f"--start-block does not apply to --order {b.order} (its sweeps begin with the block "
                             f"that scores highest); drop it")
        if self.world_size > 1:
            raise UsageError(f"--order {b.order} measures its scores in one process; drop it, or run without "
                             f"torchrun")

    def _visits_per_sweep(self) -> int:
        """The most visits a sweep makes."""
        if self.config.blocks.order in IMPORTANCE_ORDERS:
            return 1 if self.active_block is not None else len(self.partition)
        return len(self.order(0))

    def _importance_order(self, sweep: int) -> list[int]:
        """The visits of sweep `sweep` of an importance order: the progress's if it holds this sweep's (a resumed
        run), else measured now, saved in the progress and logged."""
        saved = self.progress.sweep_order
        if saved is not None and saved.get("sweep") == sweep:
            return self._saved_order(saved)
        b = self.config.blocks
        started = self.clock()
        scores, batches = self.block_scores()
        last = [-1] * len(self.partition)
        for visit in self.progress.visits:
            last[visit["block"]] = max(last[visit["block"]], visit["sweep"])
        chosen = importance_sweep(scores, last, sweep, b.importance_floor, b.order == "importance-cached",
                                  b.importance_margin)
        record = ImportanceRecord(sweep=sweep, scores=scores, order=chosen.order, chosen=chosen.chosen,
                                  spread=chosen.spread, due=chosen.due, batches=batches,
                                  seconds=self.clock() - started)
        self.progress.sweep_order = record.to_dict()
        self.emit(record)
        return list(chosen.order)

    def _saved_order(self, saved: dict) -> list[int]:
        """A checkpoint's importance sweep, checked."""
        order, scores, count = saved.get("order"), saved.get("scores"), len(self.partition)
        if not (isinstance(order, list) and all(isinstance(i, int) and 0 <= i < count for i in order)
                and isinstance(scores, list) and len(scores) == count
                and all(isinstance(x, (int, float)) for x in scores)):
            raise CheckpointError(f"{self.checkpoint_dir / STATE}: trainer.sweep_order: expected the sweep's order "
                                  f"(block numbers 0-{count - 1}) and {count} scores")
        return list(order)

    def block_scores(self) -> tuple[list[float], int]:
        """Each block's score (`preinfer.importance`) over the first `importance_batches` training batches in
        stored order (the same batches every sweep), and the batches measured; under fp16-mixed at the loss
        scaler's scale, halved until every score is finite."""
        scale = self.scaler.scale if self.scaler.enabled else 1.0
        while True:
            scores, batches = self._measure_scores(scale)
            if scale <= 1.0 or all(math.isfinite(score) for score in scores):
                return scores, batches
            scale /= 2

    def _measure_scores(self, scale: float) -> tuple[list[float], int]:
        """One measurement of the block scores, the loss multiplied by `scale`."""
        source = self.visit_sources.measure_source()
        blocks = [blk.params for blk in self.partition.blocks]
        with eval_mode(self.staged.model), GradientSquares(blocks, scale) as grads:
            for index, batch in enumerate(source.one_pass()):
                if index >= self.config.blocks.importance_batches:
                    break
                batch = _to_device(batch, self.device)
                state = batch_state(self.staged, batch, source.boundary)
                out = self.staged.run(state, source.boundary, self.staged.num_layers, self.config.run.recompute)
                loss = causal_lm_loss(self.staged.logits(out), out.labels, reduction="sum")
                (loss * scale / max(supervised_tokens(out.labels), 1)).backward()
                grads.batch_done()
        return grads.scores(), grads.batches

    def resume(self) -> None:
        """Continue from the run directory's checkpoint."""
        checkpoint = load_checkpoint(self.checkpoint_dir, self.staged.model)
        self.optimizer_states = checkpoint.optimizers
        self.progress = self.restored_progress(checkpoint.trainer, self.checkpoint_dir)
        self.saved_masters = checkpoint.masters
        if self.scaler.enabled and self.progress.loss_scaler is not None:
            self.scaler.load_state_dict(self.progress.loss_scaler)

    def restored_progress(self, state: object, directory: Path) -> Progress:
        """A checkpoint's progress, checked against this run's sweeps and blocks."""
        return type(self.progress).from_state(state, str(directory / STATE), self.config.blocks.sweeps,
                                              self._visits_per_sweep())

    @property
    def checkpoint_dir(self) -> Path:
        if self.run_dir is None:
            raise PreinferError("this trainer has no run directory to checkpoint into")
        return self.run_dir.checkpoint

    def fit(self, max_total_steps: int | None = None) -> list[dict]:
        """Run every remaining visit; stop early (after a checkpoint) once `max_total_steps` steps are done or
        when `stop_requested` is set."""
        try:
            return self._fit(max_total_steps)
        finally:
            self.log.close()

    def _fit(self, max_total_steps: int | None) -> list[dict]:
        p = self.progress
        while p.sweep < self.config.blocks.sweeps and not self._steps_spent():
            order = self.order(p.sweep)
            if p.visit == 0:
                self.visit_sources.sweep_started([self.partition.blocks[i] for i in order])
            while p.visit < len(order):
                if self._steps_spent():
                    return p.visits
                block = self.partition.blocks[order[p.visit]]
                if not self._visit(block, max_total_steps, order):
                    return p.visits
                p.visit += 1
                p.visit_step, p.stop, p.gain = 0, None, None
                self._checkpoint()
            p.sweep, p.visit = p.sweep + 1, 0
        return p.visits

    def _visit(self, block: Block, max_total_steps: int | None, order: list[int] = ()) -> bool:
        """Train `block` (visit `progress.visit` of the sweep's `order`) until its stopping rule fires; False if the
        run was halted by `max_total_steps` or a stop request."""
        p, cfg = self.progress, self.config
        train, evaluation = self.visit_sources.sources(block)
        if p.cursor is not None:
            train.load_state_dict(p.cursor)
        optimizer, active = self._activate(block, train)
        stop = StopRule.for_visit(cfg.stop, -(-train.batches_per_epoch // cfg.optim.grad_accum))
        if p.stop is not None:
            stop.load_state_dict(p.stop)
        schedule = LrSchedule.for_visit(cfg.optim, stop.max_steps, optimizer.param_groups[0]["initial_lr"])
        gain = self._gain_rule(block, order, stop.max_steps)
        if self.meter is not None:
            self.meter.reset()
        started, reason = time.perf_counter(), None
        while reason is None:
            halted = max_total_steps is not None and p.global_step >= max_total_steps
            if halted or self._stop_now():
                self._save_visit_state(train, optimizer, block, stop)
                self.stopped = not halted
                return False
            for group in optimizer.param_groups:
                group["lr"] = group["initial_lr"] * schedule.factor(p.visit_step)
            loss, tokens, wait = self.train_step(block, train, optimizer, active)
            if not math.isfinite(loss):
                raise DivergedError(f"training diverged: the loss is {loss} at step {p.global_step + 1} (sweep "
                                    f"{p.sweep}, block {block.index}); the run stopped, its last checkpoint kept; "
                                    f"start again with a lower --lr or with --grad-clip")
            p.visit_step += 1
            p.global_step += 1
            p.tokens += tokens
            reason = stop.update(loss)
            if gain is not None and gain.update(loss, self.clock()) and reason is None:
                reason = "gain"
            if reason is None and self._steps_spent():
                reason = "total-steps"
            p.stop = stop.state_dict()
            p.gain = gain.state_dict() if gain is not None else None
            p.cursor = train.state_dict()
            p.loss_scaler = self.scaler.state_dict() if self.scaler.enabled else None
            self.emit(StepRecord(
                sweep=p.sweep, block=block.index, step=p.global_step, visit_step=p.visit_step, loss=loss,
                lr=optimizer.param_groups[0]["lr"], tokens=p.tokens,
                tokens_per_s=tokens / max(wait["step_s"], 1e-9), wait_s=wait["wait_s"],
                visit_s=time.perf_counter() - started,
                time=time.time(),
                **self._scaler_fields(),
            ))
            every = cfg.run.checkpoint_every
            if every and p.global_step % every == 0 and reason is None:
                self._save_visit_state(train, optimizer, block, stop)
        wall = time.perf_counter() - started
        if cfg.optim.keep_state:
            self.optimizer_states[block.index] = optimizer.state_dict()
        self._deactivate(block)
        evaluated = time.perf_counter()
        eval_loss = self.evaluate(evaluation)
        visit = VisitRecord(
            sweep=p.sweep, block=block.index, label=block.label, steps=stop.steps, stop_reason=reason,
            eval_loss=eval_loss, wall_s=wall, tokens=p.tokens, source_boundary=train.boundary,
            memory=self.meter.report() if self.meter is not None else {},
            eval_s=time.perf_counter() - evaluated, gain=gain.report() if gain is not None else None,
        )
        p.visits.append(visit.to_dict())
        self.emit(visit)
        self.visit_sources.visit_finished(block)
        return True

    def _steps_spent(self) -> bool:
        """Whether the run has done its --total-steps."""
        total = self.config.stop.total_steps
        return total is not None and self.progress.global_step >= total

    def _gain_rule(self, block: Block, order: list[int], budget: int | None) -> GainRule | None:
        """With --stop gain: the visit's rule, against the blocks still to visit in this sweep (at its last visit,
        every other block), restored from the progress when the visit resumes; started on the clock."""
        if self.config.stop.rule != "gain":
            return None
        p = self.progress
        others = list(order[p.visit + 1:]) or [i for i in range(len(self.partition)) if i != block.index]
        if p.sweep_order is None:  # --active: the one block trains, no other is scored
            others = []
        scores = p.sweep_order["scores"] if p.sweep_order is not None else []
        own = max(scores[block.index], 1e-30) if scores else 1.0
        gain = GainRule(self.config.stop.gain_window, {str(i): scores[i] / own for i in others},
                        {str(i): self.visit_sources.switch_seconds(self.partition.blocks[i]) for i in others}, budget)
        if p.gain is not None:
            gain.load_state_dict(p.gain)
        gain.begin(self.clock())
        return gain

    def emit(self, record: Record) -> None:
        self.log.write(record)
        if self.on_record is not None:
            self.on_record(record)

    def _scaler_fields(self) -> dict:
        """fp16-mixed: the step record's loss scale and skipped-step count."""
        if not self.scaler.enabled:
            return {}
        return {"loss_scale": self.scaler.scale, "skipped_steps": self.scaler.skipped}

    def _stop_now(self) -> bool:
        """A stop was requested (on any rank: every rank stops at the same step)."""
        if self.world_size == 1:
            return self.stop_requested
        flag = torch.tensor(float(self.stop_requested), device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def _activate(self, block: Block,
                  train: BatchSource | None = None) -> tuple[torch.optim.Optimizer, ActiveBlock]:
        """Freeze everything, unfreeze `block` (with `--experts`, its chosen experts and the parts that train with
        them; chosen on the block's first visit from `train`), set train/eval modes, make the
        masters (restored from a mid-visit checkpoint when there is one) and build (or restore) their optimizer."""
        key = str(block.index)
        if key not in self.progress.experts and self.experts.layers(block) and train is not None:
            states = ((batch_state(self.staged, _to_device(b, self.device), train.boundary), train.boundary)
                      for b in train.one_pass())
            self.progress.experts[key] = self.experts.measure(block, states)
        unfreeze(self.staged, block)
        masters, self.saved_masters = self.saved_masters or None, []
        self.active = ActiveBlock(self._trained(block), self.precision != "fp32", masters)
        self.reducer = self._reducer(self.active)
        return self._optimizer(block, self.active.masters), self.active

    def _trained(self, block: Block) -> list[torch.nn.Parameter]:
        """The parameters a visit of `block` steps: all of them, or with `--experts` its chosen experts' and the
        parts that train with them."""
        return self.experts.activate(block, self.progress.experts.get(str(block.index), {}))

    def _reducer(self, active: ActiveBlock) -> BucketedAllReduce | None:
        """Data parallelism: the active block's gradient buckets, each launched as backward completes it."""
        if self.world_size == 1:
            return None
        reducer = BucketedAllReduce(active.masters)
        active.watch(reducer.grad_ready)
        return reducer

    def _optimizer(self, block: Block, tensors: list[torch.Tensor]) -> torch.optim.Optimizer:
        """The optimizer stepping `tensors` (the visit's masters; none: an optimizer over nothing, for a pipeline
        stage without part of the block), at its initial rates, with the block's kept state restored."""
        optimizer = build_optimizer(tensors or [{"params": []}], self.config.optim)
        for group in optimizer.param_groups:
            group["initial_lr"] = group["lr"]
        saved = self.optimizer_states.get(block.index)
        if saved is not None and tensors:
            optimizer.load_state_dict(saved)
        return optimizer

    def _deactivate(self, block: Block) -> None:
        """Freeze `block` again and free its masters, their gradients and (unless kept) the optimizer state."""
        self.active.close()
        self.active = self.reducer = None
        self.experts.deactivate()
        for param in block.params:
            param.requires_grad_(False)
            param.grad = None
        if not self.config.optim.keep_state:
            self.optimizer_states.pop(block.index, None)

    def train_step(self, block: Block, train: BatchSource, optimizer: torch.optim.Optimizer,
                   active: ActiveBlock) -> tuple[float, int, dict]:
        """One optimizer step over `grad_accum` micro-batches; the loss is the mean over every supervised
        token of the global batch (all micro-batches, all ranks), so accumulation and data parallelism are exact.
        The meter tracks and samples the steps it says are due. Under fp16-mixed the gradients are unscaled
        before clipping, and a step whose gradients are not finite is skipped (the weights stay as they are).
        Returns (loss, this rank's real tokens, timings)."""
        t0 = time.perf_counter()
        batches = self._fetch(train)
        wait = time.perf_counter() - t0
        count = torch.tensor(float(sum(supervised_tokens(b["labels"]) for b in batches)), device=self.device)
        self._sum_over_replicas(count)
        if self.reducer is not None:
            self.reducer.start_step()
        metered = self.meter is not None and self.meter.due()
        with self.meter.track() if metered else nullcontext():
            total, tokens = self.forward_backward_step(batches, block, train, active, count)
        if self.reducer is not None:
            self.reducer.finish()
        total, tokens = self._combine(total, tokens)
        self.experts.before_step()
        self.scaler.unscale_(optimizer)
        if self.config.optim.grad_clip > 0:
            self._clip(active, self.config.optim.grad_clip)
        if self.scaler.step(optimizer):
            active.cast_down()
            self._after_update()
        if metered:
            self.meter.sample(optimizer)
        self._zero_grad(optimizer)
        return total, tokens, {"wait_s": wait, "step_s": time.perf_counter() - t0}

    def forward_backward_step(self, batches: list[dict], block: Block, train: BatchSource, active: ActiveBlock,
                              count: torch.Tensor) -> tuple[float, int]:
        """Forward and backward of each micro-batch in turn, their gradients accumulating; returns the sum of
        their losses (each a share of the mean over the `count` supervised tokens of the global batch) and their
        real tokens."""
        total, tokens = 0.0, 0
        for index, batch in enumerate(batches):
            active.last_micro_batch = index == len(batches) - 1
            total += self._forward_backward(batch, block, train.boundary, count)
            tokens += int(batch["attention_mask"].sum())
        return total, tokens

    def _forward_backward(self, batch: dict, block: Block, boundary: int, count: torch.Tensor) -> float:
        """One micro-batch from the active block's input to the loss, and backward (the loss scaled under
        fp16-mixed); returns its loss."""
        state = self._input_state(batch, block, boundary)
        with self.router_loss.capture(block.start):
            out = self.staged.run(state, block.start, self.staged.num_layers, self.config.run.recompute)
        loss = causal_lm_loss(self.staged.logits(out), out.labels, reduction="sum") / count
        loss = loss + self.router_loss.loss(out.attention_mask) / (self.config.optim.grad_accum * self.world_size)
        self.scaler.scale_loss(loss).backward()
        return loss.item()

    def _fetch(self, train: BatchSource) -> list[dict]:
        """The step's `grad_accum` micro-batches, on the device."""
        return [_to_device(next(train), self.device) for _ in range(self.config.optim.grad_accum)]

    def _sum_over_replicas(self, tensor: torch.Tensor) -> None:
        """Sum `tensor` in place over the data-parallel ranks."""
        if self.world_size > 1:
            dist.all_reduce(tensor)

    def _combine(self, total: float, tokens: int) -> tuple[float, int]:
        """The step's loss over every rank (each holds its micro-batches' shares) and this rank's tokens."""
        if self.world_size == 1:
            return total, tokens
        summed = torch.tensor(total, device=self.device)
        dist.all_reduce(summed)
        return summed.item(), tokens

    def _clip(self, active: ActiveBlock, max_norm: float) -> None:
        """Clip the active block's gradient norm."""
        torch.nn.utils.clip_grad_norm_(active.masters, max_norm)

    def _after_update(self) -> None:
        """After the optimizer stepped and the masters were cast down (a pipeline shares its tied weight here)."""

    def _zero_grad(self, optimizer: torch.optim.Optimizer) -> None:
        optimizer.zero_grad(set_to_none=True)

    def _input_state(self, batch: dict, block: Block, boundary: int) -> BoundaryState:
        """The state at `block.start`: embedded with autograd if the block holds the embedding, else computed
        from the batch's boundary under no_grad (nothing below the active block is saved for backward)."""
        if boundary > block.start:
            raise PreinferError(f"a source at boundary {boundary} cannot feed block {block.index} "
                                f"(it starts at boundary {block.start})")
        if boundary == 0 and block.has_embed:
            return self.staged.embed(batch["input_ids"], batch["attention_mask"], batch["labels"])
        with torch.no_grad():
            state = batch_state(self.staged, batch, boundary)
            return self.staged.run(state, boundary, block.start)

    def evaluate(self, source: BatchSource) -> float:
        """Mean next-token loss over every supervised token of the source's eval pass."""
        with eval_mode(self.staged.model):
            total, count = self._eval_sums(source)
        return total / max(count, 1)

    def _eval_sums(self, source: BatchSource) -> tuple[float, int]:
        """(summed loss, supervised tokens) of the source's eval pass."""
        return eval_sums(self.staged, source, self.device)

    def _save_visit_state(self, train: BatchSource, optimizer, block: Block, stop: StopRule) -> None:
        """Checkpoint mid-visit: the active block's optimizer state travels with the others."""
        self.progress.cursor = train.state_dict()
        self.progress.stop = stop.state_dict()
        masters = self.active.masters if self.active.mixed else []
        self._checkpoint({**self.optimizer_states, block.index: optimizer.state_dict()}, masters)

    def _checkpoint(self, optimizers: dict[int, dict] | None = None, masters: list[torch.Tensor] = ()) -> None:
        if self.run_dir is None or self.rank != 0:
            return
        states = self.optimizer_states if optimizers is None else optimizers
        save_checkpoint(self.checkpoint_dir, self.staged.model, states, vars(self.progress), masters)


def unfreeze(staged: StagedModel, block: Block) -> None:
    """Freeze every parameter but `block`'s; train mode, except the frozen prefix below it (eval mode)."""
    staged.model.requires_grad_(False)
    for param in block.params:
        param.requires_grad_(True)
    staged.model.train()
    for module in staged.prefix_modules(block.start):
        module.eval()


def batch_state(staged: StagedModel, batch: dict[str, torch.Tensor], boundary: int) -> BoundaryState:
    """The boundary state a batch stands for: token batches are embedded, stored states cast to the model's
    compute dtype."""
    if boundary == 0:
        return staged.embed(batch["input_ids"], batch["attention_mask"], batch["labels"])
    state = BoundaryState.from_dict(batch)
    state.hidden = state.hidden.to(staged.compute_dtype)
    return state


def evaluate(staged: StagedModel, source: BatchSource, device: torch.device, max_batches: int | None = None) -> float:
    """Mean next-token loss over every supervised token of the source's eval pass (or its first batches)."""
    with eval_mode(staged.model):
        total, count = eval_sums(staged, source, device, max_batches)
    return total / max(count, 1)


@torch.no_grad()
def eval_sums(staged: StagedModel, source: BatchSource, device: torch.device,
              max_batches: int | None = None) -> tuple[float, int]:
    """(summed next-token loss, supervised tokens) of the source's eval pass (or its first batches)."""
    total, count = 0.0, 0
    for index, batch in enumerate(source.one_pass()):
        if max_batches is not None and index >= max_batches:
            break
        state = batch_state(staged, _to_device(batch, device), source.boundary)
        out = staged.run(state, source.boundary, staged.num_layers)
        total += causal_lm_loss(staged.logits(out), out.labels, reduction="sum").item()
        count += supervised_tokens(out.labels)
    return total, count


@contextmanager
def eval_mode(model: torch.nn.Module) -> Iterator[None]:
    """The model in eval mode inside; every module's own mode back after (mid-visit, the frozen prefix stays in
    eval mode)."""
    modes = [(module, module.training) for module in model.modules()]
    model.eval()
    try:
        yield
    finally:
        for module, training in modes:
            module.training = training


def _to_device(batch: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}
