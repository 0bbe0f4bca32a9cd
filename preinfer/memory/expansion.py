"""What landscape expansion (`expand`, `preinfer.expansion`) adds to a visit's bytes, counted as that module
allocates it. The suffix is the decoder layers above the active block, [block.stop, layers); a block holding the
head has none. `auto` (the default) is priced as the trainer resolves it in a one-GPU BCD run (`planned_expand`, by the
trainer's own rule).

- lowrank: each linear weight [out, in] of a suffix layer gets fp32 factors A [r, in] and B [out, r]:
  r * (in + out) elements, each with an fp32 gradient and the block's optimizer state (8-bit moments under
  adam8bit / adamw8bit where the tensor qualifies); under mixed precision the optimizer steps an fp32 master copy
  besides the factor itself (`preinfer.precision.ActiveBlock`). Saved for backward, per suffix layer: the inputs
  of its linear weights (A's gradient needs them, as a trained weight's does: `linear_input_bytes`), x A^T for each
  linear (b * s * r activation elements, B's gradient), and under mixed precision the 16-bit copies of A and B
  that the forward multiplies by (under fp32 they are the factors themselves).
- sgd: every parameter of the suffix layers takes a gradient in the weight dtype for the visit's backward and its
  step (no state); the suffix layers save for backward what trained layers save.

The fused step frees the block's gradients as they complete, not the suffix's (sgd steps them after the step).
The peak is per visit: the lowest block has the largest suffix.
"""

from __future__ import annotations

import dataclasses
from typing import get_args

from preinfer.config import Config
from preinfer.config.choices import Expand
from preinfer.config.rules import resolved_expand
from preinfer.errors import UsageError
from preinfer.memory.activations import StepActs, layer_activation_bytes, linear_input_bytes
from preinfer.memory.layer_spans import LayerSpan
from preinfer.memory.quantized import LOW_BIT_OPTIMIZERS, linear_shapes, moment_bytes
from preinfer.memory.settings import DTYPES, RUN_PRECISIONS, Settings
from preinfer.memory.shapes import ModelShape


def check_expand(m: ModelShape, settings: Settings) -> None:
    """A UsageError for an expansion these fields do not price."""
    if settings.expand not in get_args(Expand):
        raise UsageError(f"expand '{settings.expand}' is not one of {', '.join(get_args(Expand))}")
    if settings.expand not in ("auto", "none") and m.sparse:
        raise UsageError("--expand is priced for dense models only")


def planned_expand(m: ModelShape, settings: Settings) -> str:
    """`settings.expand` with auto resolved by the trainer's rule (`resolved_expand`) for the one-GPU BCD run
    `settings` prices."""
    return resolved_expand(planned_config(settings), sparse=any(m.sparse))


def planned_config(settings: Settings) -> Config:
    """The config of the one-GPU BCD run that `settings` prices (the keys the planner has)."""
    config = Config()
    config.blocks.expand, config.blocks.expand_rank = settings.expand, settings.expand_rank
    config.model.frozen_dtype, config.model.attention = settings.frozen_dtype, settings.attention
    config.model.stream_frozen, config.model.masters = settings.stream_frozen, settings.masters
    config.optim.name, config.optim.fused_step = settings.optimizer, settings.fused_step
    config.run.precision, config.run.recompute = RUN_PRECISIONS[settings.dtype], settings.recompute
    config.pre_inference.store_dtype = settings.store_dtype or "auto"
    return config


def layer_linears(m: ModelShape) -> list[tuple[int, int]]:
    """(out, in) of the linear weights of one dense decoder layer (GPT-2's Conv1D by its features)."""
    h, i = m.hidden, m.intermediate
    return [(3 * h, h), (h, h), (i, h), (h, i)] if m.arch == "gpt2" else linear_shapes(m)


def factor_tensors(m: ModelShape, rank: int, layers: int) -> list[int]:
    """Element counts of the lowrank factors (A, then B, per linear) of `layers` suffix layers (a linear's rank at
    most its narrower width, as `preinfer.expansion.Factors` draws them)."""
    return [n for out, inp in layer_linears(m) for n in (min(rank, out, inp) * inp, min(rank, out, inp) * out)] * layers


def expanded(m: ModelShape, settings: Settings, block: LayerSpan, grads: int, optimizer: int,
             acts: StepActs) -> tuple[int, int, StepActs]:
    """Gradient and optimizer-state bytes and the step's activations of a visit of `block` with `settings.expand`,
    from those without it (module docstring)."""
    check_expand(m, settings)
    suffix, expand = m.layers - block.stop, planned_expand(m, settings)
    if expand == "none" or suffix == 0:
        return grads, optimizer, acts
    d = DTYPES[settings.dtype]
    b, s, c = settings.micro_batch, settings.seq_len, d["act"]
    if expand == "sgd":
        grads += m.span_params(block.stop, m.layers) * d["weight"]
        return grads, optimizer, _with_layers(acts, block, lambda i: _sgd_layer_extra(m, settings, i))
    tensors = factor_tensors(m, settings.expand_rank, suffix)
    elements = sum(tensors)
    copies = 4 + (4 if d["master"] else 0)  # the fp32 factor, and under mixed precision its fp32 master
    if settings.optimizer in LOW_BIT_OPTIMIZERS:
        state = sum(moment_bytes(n, 4) for n in tensors)
    else:
        state = elements * (4 if settings.optimizer == "sgd" else 8)
    factor_grads = max(tensors) * 4 if settings.fused_step else elements * 4
    per_layer = (linear_input_bytes(m, b, s, c, None, settings.attention)
                 + len(layer_linears(m)) * b * s * settings.expand_rank * c
                 + (elements // suffix * c if d["master"] else 0))
    return grads + factor_grads, optimizer + elements * copies + state, _with_layers(acts, block, lambda i: per_layer)


def _sgd_layer_extra(m: ModelShape, settings: Settings, index: int) -> int:
    """Bytes a suffix layer trained by sgd saves beyond a frozen layer in the gradient path."""
    args = (m, settings.micro_batch, settings.seq_len, DTYPES[settings.dtype]["act"])
    return (layer_activation_bytes(*args, True, True, index, settings.attention)
            - layer_activation_bytes(*args, False, True, index, settings.attention))


def _with_layers(acts: StepActs, block: LayerSpan, extra) -> StepActs:
    """`acts` with `extra(i)` bytes more saved by each suffix layer i (with recomputation, in its recomputed set)."""
    def add(values: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(v + (extra(i) if i >= block.stop else 0) for i, v in enumerate(values))

    if acts.recomputed:
        return dataclasses.replace(acts, recomputed=add(acts.recomputed))
    return dataclasses.replace(acts, layers=add(acts.layers))
