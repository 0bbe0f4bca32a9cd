"""The BCD trainer: sweeps of visits; each visit trains one block while every other parameter stays frozen.

One step: take a batch from the visit's source (token ids, or boundary states at some boundary k), run the
frozen layers up to the active block under `no_grad` (they save nothing for backward), run the active block and
everything above it with autograd (with `run.recompute`, each of those layers keeps only its input and runs again
in backward), and step the active block's optimizer. Backward stops at the active block because its input
carries no graph.
"""

from __future__ import annotations

import time
from contextlib import nullcontext
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from preinfer.checkpoint import load_checkpoint, save_checkpoint
from preinfer.config import Config
from preinfer.errors import PreinferError
from preinfer.metrics import MetricsLog, Record, StepRecord, VisitRecord
from preinfer.optim import StopRule, build_optimizer, warmup_factor
from preinfer.partition import Block, Partition
from preinfer.run_dir import RunDir
from preinfer.schedule import parse_fixed_order, sweep_order
from preinfer.sources import BatchSource, VisitSources
from preinfer.staged import StagedModel, causal_lm_loss, supervised_tokens
from preinfer.state import BoundaryState


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
    ):
        self.staged, self.partition, self.config, self.visit_sources = staged, partition, config, sources
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
        self.order(0)  # a bad order, fixed order or start block is refused before anything runs
        sources.attach(self.emit)

    def order(self, sweep: int) -> list[int]:
        """The blocks this sweep visits (with `active_block` set, only that one)."""
        b = self.config.blocks
        order = sweep_order(b.order, len(self.partition), sweep, self.config.run.seed, b.start_block, self.fixed)
        return [i for i in order if self.active_block is None or i == self.active_block]

    def resume(self) -> None:
        """Continue from the run directory's checkpoint."""
        states, progress = load_checkpoint(self.checkpoint_dir, self.staged.model)
        self.optimizer_states = states
        self.progress = Progress(**progress)

    @property
    def checkpoint_dir(self) -> Path:
        if self.run_dir is None:
            raise PreinferError("this trainer has no run directory to checkpoint into")
        return self.run_dir.checkpoint

    def fit(self, max_total_steps: int | None = None) -> list[dict]:
        """Run every remaining visit; stop early (after a checkpoint) once `max_total_steps` steps are done."""
        p = self.progress
        while p.sweep < self.config.blocks.sweeps:
            order = self.order(p.sweep)
            if p.visit == 0:
                self.visit_sources.sweep_started([self.partition.blocks[i] for i in order])
            while p.visit < len(order):
                block = self.partition.blocks[order[p.visit]]
                if not self._visit(block, max_total_steps):
                    return p.visits
                p.visit += 1
                p.visit_step, p.stop = 0, None
                self._checkpoint()
            p.sweep, p.visit = p.sweep + 1, 0
        return p.visits

    def _visit(self, block: Block, max_total_steps: int | None) -> bool:
        """Train `block` until its stopping rule fires; False if the run was halted by `max_total_steps`."""
        p, cfg = self.progress, self.config
        train, evaluation = self.visit_sources.sources(block)
        if p.cursor is not None:
            train.load_state_dict(p.cursor)
        optimizer = self._activate(block)
        stop = StopRule.for_visit(cfg.stop, -(-train.batches_per_epoch // cfg.optim.grad_accum))
        if p.stop is not None:
            stop.load_state_dict(p.stop)
        if self.meter is not None:
            self.meter.reset()
        started, reason = time.perf_counter(), None
        while reason is None:
            if max_total_steps is not None and p.global_step >= max_total_steps:
                self._save_visit_state(train, optimizer, block, stop)
                return False
            loss, tokens, wait = self._step(block, train, optimizer)
            p.visit_step += 1
            p.global_step += 1
            p.tokens += tokens
            reason = stop.update(loss)
            p.stop = stop.state_dict()
            p.cursor = train.state_dict()
            self.emit(StepRecord(
                sweep=p.sweep, block=block.index, step=p.global_step, visit_step=p.visit_step, loss=loss,
                lr=optimizer.param_groups[0]["lr"], tokens=p.tokens,
                tokens_per_s=tokens / max(wait["step_s"], 1e-9), wait_s=wait["wait_s"],
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
            eval_s=time.perf_counter() - evaluated,
        )
        p.visits.append(visit.to_dict())
        self.emit(visit)
        self.visit_sources.visit_finished(block)
        return True

    def emit(self, record: Record) -> None:
        self.log.write(record)
        if self.on_record is not None:
            self.on_record(record)

    def _activate(self, block: Block) -> torch.optim.Optimizer:
        """Freeze everything, unfreeze `block`, set train/eval modes, and build (or restore) its optimizer."""
        model = self.staged.model
        model.requires_grad_(False)
        for param in block.params:
            param.requires_grad_(True)
        model.train()
        for module in self.staged.prefix_modules(block.start):
            module.eval()
        optimizer = build_optimizer(list(block.params), self.config.optim)
        for group in optimizer.param_groups:
            group["initial_lr"] = group["lr"]
        saved = self.optimizer_states.get(block.index)
        if saved is not None:
            optimizer.load_state_dict(saved)
        return optimizer

    def _deactivate(self, block: Block) -> None:
        for param in block.params:
            param.requires_grad_(False)
            param.grad = None
        if not self.config.optim.keep_state:
            self.optimizer_states.pop(block.index, None)

    def _step(self, block: Block, train: BatchSource, optimizer) -> tuple[float, int, dict]:
        """One optimizer step over `grad_accum` micro-batches; the loss is the mean over every supervised
        token of the global batch (all micro-batches, all ranks), so accumulation and data parallelism are exact."""
        cfg = self.config.optim
        t0 = time.perf_counter()
        batches = [_to_device(next(train), self.device) for _ in range(cfg.grad_accum)]
        wait = time.perf_counter() - t0
        count = torch.tensor(float(sum(supervised_tokens(b["labels"]) for b in batches)))
        if self.world_size > 1:
            dist.all_reduce(count)
        total, tokens = 0.0, 0
        tracking = self.meter.track() if self.meter is not None else nullcontext()
        with tracking:
            for batch in batches:
                state = self._input_state(batch, block, train.boundary)
                out = self.staged.run(state, block.start, self.staged.num_layers, self.config.run.recompute)
                loss = causal_lm_loss(self.staged.logits(out), out.labels, reduction="sum") / count
                loss.backward()
                total += loss.item()
                tokens += int(batch["attention_mask"].sum())
        if self.world_size > 1:
            for param in block.params:
                dist.all_reduce(param.grad)
            total_t = torch.tensor(total)
            dist.all_reduce(total_t)
            total = total_t.item()
        if cfg.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(block.params, cfg.grad_clip)
        factor = warmup_factor(self.progress.visit_step, cfg.warmup_steps)
        for group in optimizer.param_groups:
            group["lr"] = group["initial_lr"] * factor
        optimizer.step()
        if self.meter is not None:
            self.meter.sample(optimizer)
        optimizer.zero_grad(set_to_none=True)
        return total, tokens, {"wait_s": wait, "step_s": time.perf_counter() - t0}

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
        return evaluate(self.staged, source, self.device)

    def _save_visit_state(self, train: BatchSource, optimizer, block: Block, stop: StopRule) -> None:
        """Checkpoint mid-visit: the active block's optimizer state travels with the others."""
        self.progress.cursor = train.state_dict()
        self.progress.stop = stop.state_dict()
        self._checkpoint({**self.optimizer_states, block.index: optimizer.state_dict()})

    def _checkpoint(self, optimizers: dict[int, dict] | None = None) -> None:
        if self.run_dir is None or self.rank != 0:
            return
        states = self.optimizer_states if optimizers is None else optimizers
        save_checkpoint(self.checkpoint_dir, self.staged.model, states, vars(self.progress))


def batch_state(staged: StagedModel, batch: dict[str, torch.Tensor], boundary: int) -> BoundaryState:
    """The boundary state a batch stands for: token batches are embedded, stored states cast to the model's
    compute dtype."""
    if boundary == 0:
        return staged.embed(batch["input_ids"], batch["attention_mask"], batch["labels"])
    state = BoundaryState.from_dict(batch)
    state.hidden = state.hidden.to(staged.compute_dtype)
    return state


@torch.no_grad()
def evaluate(staged: StagedModel, source: BatchSource, device: torch.device, max_batches: int | None = None) -> float:
    """Mean next-token loss over every supervised token of the source's eval pass (or its first batches)."""
    modes = [(module, module.training) for module in staged.model.modules()]
    staged.model.eval()
    total, count = 0.0, 0
    for index, batch in enumerate(source.one_pass()):
        if max_batches is not None and index >= max_batches:
            break
        state = batch_state(staged, _to_device(batch, device), source.boundary)
        out = staged.run(state, source.boundary, staged.num_layers)
        total += causal_lm_loss(staged.logits(out), out.labels, reduction="sum").item()
        count += supervised_tokens(out.labels)
    for module, training in modes:  # mid-visit, the frozen prefix stays in eval mode
        module.training = training
    return total / max(count, 1)


def _to_device(batch: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}
