"""Cross entropy over the LM head in chunks of tokens, so that the `[tokens, vocab]` logits never exist at once.

`LinearHead` is what a staged model's head is after its final norm: one linear map (weight, optional bias) and
the elementwise terms the model's own forward applies to its output (a logit scale, a divisor, soft-capping,
an upcast), in order. `chunked_loss_sum(features, head, targets, chunk)` is the summed next-token cross entropy
of `features` ([N, H], what the head's linear receives) against `targets` ([N]): forward computes each chunk's
logits and loss and drops the logits; backward computes each chunk's logits again, and its gradients, one chunk
alive at a time. The weight's (and bias's) gradient is summed over the chunks in float32 and handed to autograd
once, so a hook on it (the fused step, mixed precision's master gradients, the data-parallel reducer) fires once
per backward, as with the plain loss. In float32 it equals the plain loss and its gradients to rounding (1e-6,
tests/test_chunked_loss.py against the framework's own forward on every family that has a linear head).

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
DEFAULT_CHUNK = 1024  # tokens a chunk: one chunk of Llama-3's 128k vocabulary is 0.49 GiB of float32 logits

Term = tuple[str, float]  # ("mul" | "div" | "softcap", value) or ("float", 0.0): applied to the logits in order


@dataclass(frozen=True)
class LinearHead:
    """The head after its final norm: `logits = terms(features @ weight.T + bias)`."""

    weight: torch.Tensor
    bias: torch.Tensor | None = None
    terms: tuple[Term, ...] = ()

    def logits(self, features: torch.Tensor) -> torch.Tensor:
        """The logits of `features`, with the ops the model's own forward runs (so in any dtype they are its own)."""
        logits = F.linear(features, self.weight, self.bias)
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


def _chunk_loss(head: LinearHead, features: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(head.logits(features).float(), targets, ignore_index=IGNORE_INDEX, reduction="sum")


class _ChunkedCrossEntropy(torch.autograd.Function):
    """Summed cross entropy of `features` through `head`, chunk by chunk in forward and again in backward."""

    @staticmethod
    def forward(ctx, features, weight, bias, targets, terms, chunk):
        head = LinearHead(weight, bias, terms)
        total = torch.zeros((), dtype=torch.float32, device=features.device)
        for start in range(0, features.shape[0], chunk):
            total += _chunk_loss(head, features[start:start + chunk], targets[start:start + chunk])
        ctx.save_for_backward(features, weight, bias, targets)
        ctx.terms, ctx.chunk = terms, chunk
        return total

    @staticmethod
    def backward(ctx, grad_total):
        features, weight, bias, targets = ctx.saved_tensors
        wants = ctx.needs_input_grad
        grad_features = torch.empty_like(features) if wants[0] else None
        grad_weight = torch.zeros_like(weight, dtype=torch.float32) if wants[1] else None
        grad_bias = torch.zeros_like(bias, dtype=torch.float32) if bias is not None and wants[2] else None
        w = weight.detach().requires_grad_(wants[1])
        b = None if bias is None else bias.detach().requires_grad_(wants[2])
        head = LinearHead(w, b, ctx.terms)
        for start in range(0, features.shape[0], ctx.chunk):
            rows = slice(start, start + ctx.chunk)
            x = features[rows].detach().requires_grad_(wants[0])
            with torch.enable_grad():
                loss = _chunk_loss(head, x, targets[rows]) * grad_total
                inputs = [t for t, want in ((x, wants[0]), (w, wants[1]), (b, wants[2])) if want and t is not None]
                grads = iter(torch.autograd.grad(loss, inputs))
            if wants[0]:
                grad_features[rows] = next(grads)
            if wants[1]:
                grad_weight += next(grads)
            if grad_bias is not None:
                grad_bias += next(grads)
        return (grad_features, None if grad_weight is None else grad_weight.to(weight.dtype),
                None if grad_bias is None else grad_bias.to(bias.dtype), None, None, None)


def chunked_loss_sum(features: torch.Tensor, head: LinearHead, targets: torch.Tensor, chunk: int) -> torch.Tensor:
    """Summed cross entropy of `features` [N, H] through `head` against `targets` [N] (IGNORE_INDEX counts
    nothing), computed `chunk` tokens at a time in forward and backward."""
    return _ChunkedCrossEntropy.apply(features, head.weight, head.bias, targets, head.terms, chunk)


def counted_rows(hidden: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(features, targets) of the supervised positions of `hidden` [B, T, H]: position t of a row where label t+1
    is not IGNORE_INDEX (the shift of a next-token loss), the others left out."""
    batch, length = labels.shape
    shifted = torch.full_like(labels, IGNORE_INDEX)
    shifted[:, :-1] = labels[:, 1:]
    index = (shifted.flatten() != IGNORE_INDEX).nonzero().squeeze(1)
    return hidden.reshape(batch * length, -1).index_select(0, index), shifted.flatten()[index]


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
