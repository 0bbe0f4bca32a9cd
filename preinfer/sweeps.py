"""Sweeps and stopping: which blocks each sweep visits, and what ends a visit or the run early.

A fixed order (`preinfer.block_order.sweep_order`) is a function of the sweep; an importance order is measured at
the sweep's start (`preinfer.importance`, a forward and backward through every block over a few training batches)
and chosen by `block_order.importance_sweep`; the scores and the chosen visits are saved in the run's position, so
a run resumed mid-sweep follows the same visits. `--stop gain` (`preinfer.gain`) ends a visit when another block
is predicted to lower the loss faster; its times come from `clock`. `--total-steps` ends the run at that step,
mid-visit and mid-sweep.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import torch

from preinfer.batch_source import VisitSources
from preinfer.block_order import IMPORTANCE_ORDERS, importance_sweep, parse_fixed_order, sweep_order
from preinfer.config import Config
from preinfer.errors import CheckpointError, UsageError
from preinfer.evaluation import eval_mode
from preinfer.forward_backward import batch_state, to_device
from preinfer.gain import GainRule
from preinfer.importance import GradientSquares
from preinfer.metrics import ImportanceRecord, Record
from preinfer.partition import Block, Partition
from preinfer.precision import LossScaler
from preinfer.run_position import RunPosition
from preinfer.staged import StagedModel, supervised_tokens


class Sweeps:
    """The visits of each sweep, the importance measurements, the gain rule and the run's step budget."""

    def __init__(self, staged: StagedModel, partition: Partition, config: Config, sources: VisitSources,
                 scaler: LossScaler, clock: Callable[[], float], emit: Callable[[Record], None],
                 state_file: Callable[[], Path], active_block: int | None = None, world_size: int = 1):
        self.staged, self.partition, self.config, self.sources = staged, partition, config, sources
        self.scaler, self.clock, self.emit, self.state_file = scaler, clock, emit, state_file
        self.active_block, self.device = active_block, torch.device(config.run.device)
        b = config.blocks
        self.fixed = parse_fixed_order(b.fixed_order, len(partition)) if b.fixed_order else None
        if b.order not in IMPORTANCE_ORDERS:
            self.order(0, RunPosition())  # a bad order, fixed order or start block is refused before anything runs
        elif world_size > 1:
            raise UsageError(f"--order {b.order} measures its scores in one process; drop it, or run without "
                             f"torchrun")

    def order(self, sweep: int, position: RunPosition) -> list[int]:
        """The blocks this sweep visits (with `active_block` set, only that one); an importance order's are measured
        here at the sweep's start, or taken from the position when it holds this sweep's."""
        b = self.config.blocks
        if b.order in IMPORTANCE_ORDERS:
            return [self.active_block] if self.active_block is not None else self._importance_order(sweep, position)
        order = sweep_order(b.order, len(self.partition), sweep, self.config.run.seed, b.start_block, self.fixed)
        return [i for i in order if self.active_block is None or i == self.active_block]

    def visits_per_sweep(self) -> int:
        """The most visits a sweep makes."""
        if self.config.blocks.order in IMPORTANCE_ORDERS:
            return 1 if self.active_block is not None else len(self.partition)
        return len(self.order(0, RunPosition()))

    def _importance_order(self, sweep: int, position: RunPosition) -> list[int]:
        """The visits of sweep `sweep` of an importance order: the position's if it holds this sweep's (a resumed
        run), else measured now, saved in the position and logged."""
        saved = position.sweep_order
        if saved is not None and saved.get("sweep") == sweep:
            return self._saved_order(saved)
        b = self.config.blocks
        started = self.clock()
        scores, batches = self.block_scores()
        last = [-1] * len(self.partition)
        for visit in position.visits:
            last[visit["block"]] = max(last[visit["block"]], visit["sweep"])
        chosen = importance_sweep(scores, last, sweep, b.importance_floor, b.order == "importance-cached",
                                  b.importance_margin)
        record = ImportanceRecord(sweep=sweep, scores=scores, order=chosen.order, chosen=chosen.chosen,
                                  spread=chosen.spread, due=chosen.due, batches=batches,
                                  seconds=self.clock() - started)
        position.sweep_order = record.to_dict()
        self.emit(record)
        return list(chosen.order)

    def _saved_order(self, saved: dict) -> list[int]:
        """A checkpoint's importance sweep, checked."""
        order, scores, count = saved.get("order"), saved.get("scores"), len(self.partition)
        if not (isinstance(order, list) and all(isinstance(i, int) and 0 <= i < count for i in order)
                and isinstance(scores, list) and len(scores) == count
                and all(isinstance(x, (int, float)) for x in scores)):
            raise CheckpointError(f"{self.state_file()}: trainer.sweep_order: expected the sweep's order "
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
        source = self.sources.measure_source()
        blocks = [blk.params for blk in self.partition.blocks]
        with eval_mode(self.staged.model), GradientSquares(blocks, scale) as grads:
            for index, batch in enumerate(source.one_pass()):
                if index >= self.config.blocks.importance_batches:
                    break
                state = batch_state(self.staged, to_device(batch, self.device), source.boundary)
                out = self.staged.run(state, source.boundary, self.staged.num_layers, self.config.run.recompute)
                loss = self.staged.loss_sum(out)
                (loss * scale / max(supervised_tokens(out.labels), 1)).backward()
                grads.batch_done()
        return grads.scores(), grads.batches

    def steps_spent(self, position: RunPosition) -> bool:
        """Whether the run has done its --total-steps."""
        total = self.config.stop.total_steps
        return total is not None and position.global_step >= total

    def budget_ends_before_visit(self, position: RunPosition) -> bool:
        """Whether the run's --total-steps are done at a visit's start: not within a visit it cut, which a resumed
        run continues (a raised budget) or closes without a step (the same budget)."""
        return self.steps_spent(position) and position.visit_step == 0

    def gain_rule(self, block: Block, order: list[int], budget: int | None, position: RunPosition) -> GainRule | None:
        """With --stop gain: the visit's rule, against the blocks still to visit in this sweep (at its last visit,
        every other block), restored from the position when the visit resumes; started on the clock."""
        if self.config.stop.rule != "gain":
            return None
        p = position
        others = list(order[p.visit + 1:]) or [i for i in range(len(self.partition)) if i != block.index]
        if p.sweep_order is None:  # --active: the one block trains, no other is scored
            others = []
        scores = p.sweep_order["scores"] if p.sweep_order is not None else []
        own = max(scores[block.index], 1e-30) if scores else 1.0
        gain = GainRule(self.config.stop.gain_window, {str(i): scores[i] / own for i in others},
                        {str(i): self.sources.switch_seconds(self.partition.blocks[i]) for i in others}, budget)
        if p.gain is not None:
            gain.load_state_dict(p.gain)
        gain.begin(self.clock())
        return gain
