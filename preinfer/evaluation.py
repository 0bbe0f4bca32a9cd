"""Evaluation: the mean next-token loss over every supervised token of an eval pass."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from preinfer.batch_source import BatchSource
from preinfer.forward_backward import batch_state, to_device
from preinfer.staged import StagedModel, supervised_tokens


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
        state = batch_state(staged, to_device(batch, device), source.boundary)
        out = staged.run(state, source.boundary, staged.num_layers)
        total += staged.loss_sum(out).item()
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
