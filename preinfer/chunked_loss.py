"""Cross entropy over the LM head in chunks of tokens, so that the `[tokens, vocab]` logits never exist at once.

`LinearHead` is what a staged model's head is after its final norm: one linear map (weight, optional bias) and
the elementwise terms the model's own forward applies to its output (a logit scale, a divisor, soft-capping,
an upcast), in order. `chunked_loss_sum(features, head, targets, chunk)` is the summed next-token cross entropy
of `features` ([N, H], what the head's linear receives) against `targets` ([N]): forward computes each chunk's
logits and loss and drops the logits; backward computes each chunk's logits again, and its gradients, one chunk
alive at a time. The weight's (and bias's) gradient is summed over the chunks in its dtype and handed to autograd
once, so a hook on it (the fused step, mixed precision's master gradients, the data-parallel reducer) fires once
per backward, as with the plain loss. In float32 it equals the plain loss and its gradients to rounding (1e-6,
tests/test_families.py against the framework's own forward on every family that has a linear head).

`--loss liger` hands the same features, weight and targets to Liger Kernel's fused linear cross entropy (a CUDA
kernel; the `liger` extra), imported only when asked for.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from preinfer.errors import UsageError
from preinfer.liger_extra import liger_installed

IGNORE_INDEX = -100

Term = tuple[str, float]  # ("mul" | "div" | "softcap", value) or ("float", 0.0): applied to the logits in order


@dataclass(frozen=True)
class LinearHead:
    """The head after its final norm: `logits = terms(features @ weight.T + bias)`."""

    weight: torch.Tensor
    bias: torch.Tensor | None = None
    terms: tuple[Term, ...] = ()

    def logits(self, features: torch.Tensor) -> torch.Tensor:
        """The logits of `features`, with the ops the model's own forward runs (so in any dtype they are its own)."""
        return self.scaled(F.linear(features, self.weight, self.bias))

    def scaled(self, logits: torch.Tensor) -> torch.Tensor:
        """The terms applied to the linear map's output, in order."""
        for op, value in self.terms:
            if op == "mul":
                logits = logits * value
            elif op == "div":
                logits = logits / value
            elif op == "softcap":
                logits = torch.tanh(logits / value) * value
            else:
                logits = logits.float()
        return logits


def _summed(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float(), targets, ignore_index=IGNORE_INDEX, reduction="sum")


class _ChunkedCrossEntropy(torch.autograd.Function):
    """Summed cross entropy of `features` through the head, chunk by chunk in forward and again in backward.

    Backward takes each chunk's gradient of the linear map's output `z` through the terms and the cross entropy
    by autograd, then the input's (`g @ W`) and the weight's and bias's (`g^T x`, added in place into one
    gradient in their dtype, as autograd sums a weight's gradients over its uses: no buffer beyond it)."""

    @staticmethod
    def forward(ctx, features, weight, bias, targets, terms, chunk):
        head = LinearHead(weight, bias, terms)
        total = torch.zeros((), dtype=torch.float32, device=features.device)
        for start in range(0, features.shape[0], chunk):
            total += _summed(head.logits(features[start:start + chunk]), targets[start:start + chunk])
        ctx.save_for_backward(features, weight, bias, targets)
        ctx.terms, ctx.chunk = terms, chunk
        return total

    @staticmethod
    def backward(ctx, grad_total):
        features, weight, bias, targets = ctx.saved_tensors
        wants_x, wants_w, wants_b = ctx.needs_input_grad[:3]
        head = LinearHead(weight, bias, ctx.terms)
        grad_x = torch.empty_like(features) if wants_x else None
        grad_w = torch.zeros_like(weight) if wants_w else None
        grad_b = torch.zeros_like(bias) if bias is not None and wants_b else None
        for start in range(0, features.shape[0], ctx.chunk):
            rows = slice(start, start + ctx.chunk)
            g = _logit_gradient(head, features[rows], targets[rows], grad_total)
            if grad_x is not None:
                grad_x[rows] = g @ weight
            if grad_w is not None:
                grad_w.addmm_(g.t(), features[rows])
            if grad_b is not None:
                grad_b += g.sum(0)
            del g  # before the next chunk's logits
        return grad_x, grad_w, grad_b, None, None, None


def _logit_gradient(head: LinearHead, x: torch.Tensor, targets: torch.Tensor, grad_total: torch.Tensor) -> torch.Tensor:
    """The gradient of `grad_total` x the chunk's summed cross entropy with respect to the output of the head's
    linear map (its logits computed again; they and their log-softmax freed on return)."""
    z = F.linear(x, head.weight, head.bias).requires_grad_()
    with torch.enable_grad():
        return torch.autograd.grad(_summed(head.scaled(z), targets) * grad_total, z)[0]


def chunked_loss_sum(features: torch.Tensor, head: LinearHead, targets: torch.Tensor, chunk: int) -> torch.Tensor:
    """Summed cross entropy of `features` [N, H] through `head` against `targets` [N] (IGNORE_INDEX counts
    nothing), computed `chunk` tokens at a time in forward and backward."""
    return _ChunkedCrossEntropy.apply(features, head.weight, head.bias, targets, head.terms, chunk)


def shifted_rows(hidden: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(features [B * T, H], targets [B * T]) of `hidden` [B, T, H] for a next-token loss: position t's target is
    label t+1, the last position's IGNORE_INDEX. Every position is kept (a view, no copy), so that every batch's
    tensors have the same shapes; a masked one costs its share of the head's work and counts nothing."""
    batch, length = labels.shape
    targets = torch.full_like(labels, IGNORE_INDEX)
    targets[:, :-1] = labels[:, 1:]
    return hidden.reshape(batch * length, -1), targets.flatten()


def liger_loss_sum(features: torch.Tensor, head: LinearHead, targets: torch.Tensor) -> torch.Tensor:
    """Summed cross entropy of `features` through `head` by Liger Kernel's fused linear cross entropy (CUDA), for a
    head whose only term is soft-capping."""
    if not liger_installed():
        raise UsageError("--loss liger needs liger-kernel, which is not installed: pip install preinfer[liger]")
    softcaps = [value for op, value in head.terms if op == "softcap"]
    if len(softcaps) != len(head.terms):
        raise UsageError("--loss liger: this head scales its logits (a term Liger's kernel does not take); use "
                         "--loss chunked")
    loss = importlib.import_module("liger_kernel.transformers").LigerFusedLinearCrossEntropyLoss(
        ignore_index=IGNORE_INDEX, reduction="sum", softcap=softcaps[0] if softcaps else None)
    return loss(head.weight, features, targets, head.bias)
