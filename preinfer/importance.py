"""Block scores for the importance orders: each block's gradient norm per parameter.

A block's score is the root mean square of its loss gradient, per parameter and per batch:

    score_b = sqrt( (1 / B) * sum_i ||grad_b L_i||^2 / n_b )

over the B measurement batches i (L_i: batch i's mean next-token loss over its supervised tokens), where n_b is
the block's parameter count. Dividing by n_b makes blocks of different sizes comparable (the embedding and a
decoder layer); averaging the squared norm over batches, rather than taking the norm of the averaged gradient, lets
each gradient be added up and freed the moment backward completes it: the measurement never holds more than one
parameter's gradient, and no optimizer state.

The measurement runs one forward and one backward through every block per batch, in eval mode (no dropout, no
random state consumed), every block's parameters requiring grad inside it only; the weights are not changed and the
gradients are discarded. Under fp16-mixed the loss is multiplied by the loss scaler's scale (as in training, so
that small gradients do not underflow in 16 bits) and each gradient divided by it before it is squared; a
measurement with a non-finite sum is taken again at half the scale.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn


class GradientSquares:
    """Inside: every parameter of `blocks` requires grad, and each gradient, as backward completes it, is added
    squared (in fp32, divided by `scale`: the factor the loss was multiplied by) to its block's sum and freed.
    After: the parameters' requires_grad flags as they were."""

    def __init__(self, blocks: Sequence[Sequence[nn.Parameter]], scale: float = 1.0):
        self.blocks = [list(params) for params in blocks]
        self.scale = scale
        self.sums: list[torch.Tensor | float] = [0.0] * len(self.blocks)
        self.batches = 0
        self._hooks: list = []
        self._flags: list[tuple[nn.Parameter, bool]] = []

    def __enter__(self) -> GradientSquares:
        for index, params in enumerate(self.blocks):
            for param in params:
                self._flags.append((param, param.requires_grad))
                param.requires_grad_(True)
                param.grad = None
                self._hooks.append(param.register_post_accumulate_grad_hook(
                    lambda p, index=index: self._add(index, p)))
        return self

    def __exit__(self, *exc: object) -> None:
        for hook in self._hooks:
            hook.remove()
        for param, flag in self._flags:
            param.grad = None
            param.requires_grad_(flag)
        self._hooks, self._flags = [], []

    def _add(self, index: int, param: nn.Parameter) -> None:
        self.sums[index] = self.sums[index] + (param.grad.detach().float() / self.scale).pow(2).sum()
        param.grad = None

    def batch_done(self) -> None:
        """Count one batch's backward."""
        self.batches += 1

    def scores(self) -> list[float]:
        """Each block's score: sqrt(mean over batches of its squared gradient norm / its parameter count)."""
        out = []
        for total, params in zip(self.sums, self.blocks):
            count = sum(p.numel() for p in params)
            out.append(float(torch.as_tensor(total, dtype=torch.float64).sqrt() /
                             (max(self.batches, 1) * max(count, 1)) ** 0.5))
        return out
