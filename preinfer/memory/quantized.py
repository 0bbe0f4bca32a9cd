"""What frozen weights in fewer bits (`frozen_dtype`), 8-bit Adam moments (`optimizer` adam8bit, adamw8bit) and a
step fused into backward (`fused_step`) change in a visit's bytes, counted as preinfer.frozen_weights and preinfer.low_bit (torchao)
allocate them.

- Frozen weights: every `nn.Linear` weight of a resident decoder layer outside the active block is held as codes
  (norms, biases, the embedding and the LM head stay in the resident dtype); w = bytes of the resident dtype.
  bf16: 2 bytes per element; int8: 1 byte per element and a float32 scale per row; nf4: half a byte per element,
  an int8 absmax per 64-block, a w-byte factor per scaler block (up to 256 absmaxes), a w-byte mean and a 16-entry
  w-byte table per tensor. Every managed weight also has a master in host memory (`host`, w bytes per element),
  which on a CPU device (`host_device`) is the same memory as the codes.
- 8-bit moments: a trainable tensor of at least 4096 elements and a multiple of 256 keeps each of its two moments
  as 1 byte per element, a float32 scale per 256 elements and a 256-entry float32 map; smaller ones keep two
  moments in the optimizer tensors' dtype.
- Fused step: each gradient is freed as its step runs in backward, so the gradient bytes are the largest trainable
  tensor's instead of the block's.
"""

from __future__ import annotations

import functools
from typing import get_args

from preinfer.config.choices import LOW_BIT_OPTIMIZERS, FrozenDtype, Optimizer
from preinfer.errors import UsageError
from preinfer.memory.layer_spans import LayerSpan
from preinfer.memory.settings import DTYPES, Settings
from preinfer.memory.shapes import ModelShape

FROZEN_DTYPES = get_args(FrozenDtype)[1:]  # bf16, int8, nf4; and "auto": the resident dtype
NF4_BLOCK, NF4_SCALER_BLOCK = 64, 256
LOW_BIT_BLOCK, LOW_BIT_MIN = 256, 4096


def linear_shapes(m: ModelShape) -> list[tuple[int, int]]:
    """(rows, columns) of the `nn.Linear` weights of one dense Llama-shaped decoder layer."""
    h, q, kv, i = m.hidden, m.heads * m.head_dim, m.kv_heads * m.head_dim, m.intermediate
    return [(q, h), (kv, h), (kv, h), (h, q), (i, h), (i, h), (h, i)]


def layer_tensors(m: ModelShape) -> list[int]:
    """Element counts of one dense decoder layer's parameter tensors."""
    h, i = m.hidden, m.intermediate
    if m.arch == "gpt2":  # c_attn, c_proj, c_fc, c_proj (weight, bias), two LayerNorms (weight, bias)
        return [h * 3 * h, 3 * h, h * h, h, h * i, i, i * h, h, h, h, h, h]
    biases = [m.heads * m.head_dim, m.kv_heads * m.head_dim, m.kv_heads * m.head_dim] if m.bias else []
    return [rows * cols for rows, cols in linear_shapes(m)] + biases + [h, h]


def block_tensors(m: ModelShape, block: LayerSpan) -> list[int]:
    """Element counts of the active block's trainable tensors."""
    return layer_tensors(m) * (block.stop - block.start) + end_tensors(m, block)


def end_tensors(m: ModelShape, block: LayerSpan) -> list[int]:
    """Element counts of the trainable tensors of the block's ends: the embedding, the final norm and the head."""
    tensors = []
    if block.embed:
        tensors += [m.vocab * m.hidden] + ([m.positions * m.hidden] if m.positions else [])
    if block.head:
        tensors += [m.hidden] * (2 if m.arch == "gpt2" else 1) + ([] if m.tied else [m.vocab * m.hidden])
    return tensors


def nf4_scaler_block(numel: int) -> int:
    """The scaler block of an NF4 weight of `numel` elements: the largest divisor of its 64-blocks up to 256."""
    blocks = numel // NF4_BLOCK
    return next(size for size in range(min(NF4_SCALER_BLOCK, blocks), 0, -1) if blocks % size == 0)


def frozen_linear_bytes(rows: int, cols: int, frozen_dtype: str, weight_bytes: int) -> int:
    """Device bytes of one frozen linear weight held in `frozen_dtype` (module docstring)."""
    n = rows * cols
    if frozen_dtype == "bf16":
        return 2 * n
    if frozen_dtype == "int8":
        return n + 4 * rows
    blocks = n // NF4_BLOCK
    return n // 2 + blocks + (blocks // nf4_scaler_block(n)) * weight_bytes + 17 * weight_bytes


def moment_bytes(n: int, plain_bytes: int) -> int:
    """Bytes of 8-bit Adam's two moments of an n-element tensor (`plain_bytes` per moment element if unquantized)."""
    if n >= LOW_BIT_MIN and n % LOW_BIT_BLOCK == 0:
        return 2 * (n + 4 * (n // LOW_BIT_BLOCK) + 4 * 256)
    return 2 * n * plain_bytes


def check_settings(m: ModelShape, settings: Settings) -> None:
    """A UsageError for a value or a model these fields do not price."""
    if settings.frozen_dtype not in ("auto", *FROZEN_DTYPES):
        raise UsageError(f"frozen dtype '{settings.frozen_dtype}' is not one of auto, {', '.join(FROZEN_DTYPES)}")
    if settings.optimizer not in get_args(Optimizer):
        raise UsageError(f"optimizer '{settings.optimizer}' is not one of {', '.join(get_args(Optimizer))}")
    changed = settings.frozen_dtype != "auto" or settings.optimizer in LOW_BIT_OPTIMIZERS or settings.fused_step
    if changed and m.sparse:
        raise UsageError("the frozen dtype, 8-bit optimizer and fused step are priced for dense models only")
    if settings.frozen_dtype != "auto" and m.arch != "llama":
        raise UsageError(f"frozen dtype {settings.frozen_dtype} holds nn.Linear weights; GPT-2's Conv1D has none")
    odd = [(rows, cols) for rows, cols in linear_shapes(m) if rows * cols % NF4_BLOCK]
    if settings.frozen_dtype == "nf4" and odd:  # as preinfer.frozen_weights refuses it in a run
        rows, cols = odd[0]
        raise UsageError(f"frozen dtype nf4 needs weights whose element count is divisible by {NF4_BLOCK}; "
                         f"{m.name}'s {rows}x{cols} linear weight has {rows * cols}: use int8 or bf16")


def frozen_weights(m: ModelShape, settings: Settings, frozen: int, resident: int) -> tuple[int, int]:
    """Bytes the frozen dtype changes on the device with `frozen` of the `resident` decoder layers held as codes,
    and the host bytes of the masters of every resident layer's linear weights."""
    if settings.frozen_dtype == "auto":
        return 0, 0
    w = DTYPES[settings.dtype]["weight"]
    per_layer = sum(r * c for r, c in linear_shapes(m))
    return frozen * (coded_layer_bytes(m, settings.frozen_dtype, w) - per_layer * w), resident * per_layer * w


@functools.lru_cache(maxsize=64)
def coded_layer_bytes(m: ModelShape, frozen_dtype: str, weight_bytes: int) -> int:
    """Device bytes of one decoder layer's linear weights held in `frozen_dtype`."""
    return sum(frozen_linear_bytes(r, c, frozen_dtype, weight_bytes) for r, c in linear_shapes(m))


def active_state(m: ModelShape, settings: Settings, span: LayerSpan, grads: int, optimizer: int) -> tuple[int, int]:
    """Gradient and optimizer-state bytes of the trainable `span` under the 8-bit optimizer and the fused step,
    from today's `grads` and `optimizer`."""
    check_settings(m, settings)
    d = DTYPES[settings.dtype]
    layers, layer, ends = span.stop - span.start, layer_tensors(m), end_tensors(m, span)
    if settings.optimizer in LOW_BIT_OPTIMIZERS:  # each layer's tensors alike: summed once, times the layers
        plain = 4 if d["master"] else d["moments"] // 2
        optimizer = ((layers * sum(layer) + sum(ends)) * d["master"]
                     + layers * sum(moment_bytes(n, plain) for n in layer) + sum(moment_bytes(n, plain) for n in ends))
    if settings.fused_step:
        grads = max([*(layer if layers else []), *ends]) * d["grad"]
    return grads, optimizer


def adjust(m: ModelShape, settings: Settings, block: LayerSpan, first_resident: int,
           parts: tuple[int, int, int]) -> tuple[int, int, int, int]:
    """Weights, gradients, optimizer state and host bytes of a visit whose resident layers start at
    `first_resident`, from today's `parts` (weights, gradients, optimizer state)."""
    weights, grads, optimizer = parts
    grads, optimizer = active_state(m, settings, block, grads, optimizer)
    frozen = (block.start - first_resident) + (m.layers - block.stop)
    delta, host = frozen_weights(m, settings, frozen, m.layers - first_resident)
    return weights + delta, grads, optimizer, host
