"""One visit's lifecycle: activate a block, train it step by step, deactivate it.

One step (`VisitLifecycle.train_step`): take `grad_accum` batches from the visit's source (token ids, or boundary
states at some boundary k), count their supervised tokens over every replica, run forward and backward over them
(`Layout.forward_backward`: in one process `preinfer.forward_backward`), sum the gradients over the replicas,
combine the loss, and step the active block's optimizer (`VisitOptimizer.step`: unscale, clip in fp32, step, cast
the masters down). The layout (`preinfer.layout`) is the seam where a pipeline runs the same step over its
stages; a `VisitHook` is the seam where a visit brings in and takes out what it needs besides its block's optimizer
(frozen weights held in fewer bits, landscape expansion over the suffix).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from contextlib import nullcontext
from typing import Protocol

import torch

from preinfer.batch_source import BatchSource
from preinfer.config import Config
from preinfer.errors import UsageError
from preinfer.forward_backward import batch_state, to_device
from preinfer.layout import Layout
from preinfer.moe import ExpertGranular
from preinfer.partition import Block
from preinfer.run_position import RunPosition
from preinfer.staged import StagedModel, supervised_tokens
from preinfer.visit_optimizer import VisitOptimizer, VisitOptimizers


class VisitHook(Protocol):
    """What a visit brings in and takes out besides its block's weights and optimizer, in this order: `activate`
    after the block is unfrozen and before its optimizer opens, `after_step` after each optimizer step,
    `deactivate` after the optimizer closed and the block is frozen again."""

    def activate(self, block: Block) -> list[torch.nn.Parameter]:
        """Ready the model for `block`'s visit; the parameters the visit's optimizer steps besides the block's."""

    def after_step(self) -> None:
        """After each optimizer step of the visit (whether or not it stepped)."""

    def deactivate(self, block: Block) -> None:
        """End what `activate` began for `block`."""


class VisitLifecycle:
    """Activates, steps and deactivates the visits of a run on `layout`."""

    def __init__(self, staged: StagedModel, config: Config, layout: Layout, optimizers: VisitOptimizers,
                 experts: ExpertGranular, meter=None, hooks: Sequence[VisitHook] = ()):
        self.staged, self.config, self.layout, self.optimizers = staged, config, layout, optimizers
        self.experts, self.meter, self.hooks = experts, meter, tuple(hooks)
        self.extras = 0  # how many of the open visit's parameters the hooks gave
        self.device = torch.device(config.run.device)

    def activate(self, block: Block, position: RunPosition, train: BatchSource | None = None,
                 steps: int | None = None, masters: list[torch.Tensor] | None = None) -> VisitOptimizer:
        """Freeze everything, unfreeze `block` (with `--experts`, its chosen experts and the parts that train with
        them; chosen on the block's first visit from `train`), set train/eval modes, and open the visit's
        optimizer for at most `steps` steps (with the masters of a mid-visit checkpoint when there are some)."""
        key = str(block.index)
        if key not in position.experts and self.experts.layers(block) and train is not None:
            states = ((batch_state(self.staged, to_device(b, self.device), train.boundary), train.boundary)
                      for b in train.one_pass())
            position.experts[key] = self.experts.measure(block, states)
        unfreeze(self.staged, block)
        params = self.experts.activate(block, position.experts.get(key, {})) if self.experts.layers(block) \
            else self.layout.trained(block)
        extras = activate_hooks(self.hooks, block, masters)
        self.extras = len(extras)
        mixed = self.optimizers.precision.mixed
        visit = self.optimizers.open(block.index, [*params, *extras], steps, masters if mixed else None,
                                     extras=len(extras))
        self.experts.attach(visit.active)
        self.layout.activate(block, train.boundary if train is not None else 0, visit)
        return visit

    def checkpointed(self, visit: VisitOptimizer) -> list[torch.Tensor]:
        """The tensors a mid-visit checkpoint carries for `visit` (its `masters`, see `checkpointed`)."""
        return checkpointed(visit, self.extras)

    def train_step(self, block: Block, train: BatchSource, visit: VisitOptimizer) -> tuple[float, int, dict]:
        """One optimizer step over `grad_accum` micro-batches; the loss is the mean over every supervised
        token of the global batch (all micro-batches, all ranks), so accumulation and data parallelism are exact.
        The meter tracks and samples the steps it says are due. Under fp16-mixed a step whose gradients are not
        finite is skipped (the weights stay as they are). Returns (loss, this rank's real tokens, timings)."""
        t0 = time.perf_counter()
        batches = self.layout.fetch(train, self.config.optim.grad_accum)
        wait = time.perf_counter() - t0
        count = torch.tensor(float(sum(supervised_tokens(b["labels"]) for b in batches)), device=self.device)
        self.layout.sum_over_replicas(count)
        metered = self.meter is not None and self.meter.due()
        with self.meter.track() if metered else nullcontext():
            total, tokens = self.layout.forward_backward(batches, block, train.boundary, count, visit)
        self.layout.reduce()
        total, tokens = self.layout.combine(total, tokens)
        self.experts.before_step()
        if visit.step(self.layout.clip):
            self.layout.after_update()
        for hook in self.hooks:
            hook.after_step()
        if metered:
            self.meter.sample(visit.optimizer)
        visit.zero_grad()
        self.layout.zero_grad()
        return total, tokens, {"wait_s": wait, "step_s": time.perf_counter() - t0}

    def deactivate(self, block: Block, visit: VisitOptimizer, position: RunPosition) -> None:
        """Freeze `block` again and free its masters, their gradients and (unless kept) the optimizer state; the
        position takes the data cursor every process reads on from."""
        position.cursor = self.layout.shared_cursor(position.cursor)
        self.optimizers.close(block.index, visit)
        self.experts.deactivate()
        freeze(block)
        self.layout.deactivate()
        for hook in reversed(self.hooks):
            hook.deactivate(block)


def activate_hooks(hooks: Sequence[VisitHook], block: Block,
                   masters: Sequence[torch.Tensor] | None) -> list[torch.nn.Parameter]:
    """The hooks' parameters for `block`'s visit; resuming mid-visit (`masters` from its checkpoint, which end
    with the hooks' parameters), with their saved values."""
    extras = [extra for hook in hooks for extra in hook.activate(block)]
    if masters and extras:
        saved = masters[-len(extras):]
        if [tuple(t.shape) for t in saved] != [tuple(t.shape) for t in extras]:
            raise UsageError("the checkpoint's expansion tensors have other shapes than this visit's: resume with "
                             "the expand and expand_rank the checkpoint was trained with")
        with torch.no_grad():
            for extra, value in zip(extras, saved):
                extra.copy_(value)
    return extras


def checkpointed(visit: VisitOptimizer, extras: int) -> list[torch.Tensor]:
    """The tensors a mid-visit checkpoint carries for `visit`, whose last `extras` tensors are the hooks': under
    mixed precision every master, the hooks' last; under fp32 the hooks' parameters (the block's own are the
    model's weights)."""
    if visit.active.mixed:
        return list(visit.active.masters)
    return visit.active.masters[len(visit.active.masters) - extras:]


def unfreeze(staged: StagedModel, block: Block) -> None:
    """Freeze every parameter but `block`'s; train mode, except the frozen prefix below it (eval mode)."""
    staged.model.requires_grad_(False)
    for param in block.params:
        param.requires_grad_(True)
    staged.model.train()
    for module in staged.prefix_modules(block.start):
        module.eval()


def freeze(block: Block) -> None:
    """Freeze `block` and drop its weights' gradients."""
    for param in block.params:
        param.requires_grad_(False)
        param.grad = None
