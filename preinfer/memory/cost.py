"""Training FLOPs per token, and the GPU-hours and dollars of a run."""

from __future__ import annotations

from preinfer.memory.layer_spans import LayerSpan
from preinfer.memory.settings import GPUS, Settings
from preinfer.memory.shapes import ModelShape


def flops_per_token(m: ModelShape, blocks: list[LayerSpan], epochs_per_visit: float) -> dict:
    """Training FLOPs per token: 6N for full Adam (2N forward, 4N backward; attention's s^2 terms neglected).

    N counts matmul parameters a token runs through (layers, a sparse layer's router and top-k experts only, and
    the LM head; an embedding lookup costs nothing). For a visit of
    block k: forward 2N; backward 2N_above + 4N_k (input gradients above and in the block, weight gradients in
    it). From a store, the forward skips the prefix but one caching pass per visit runs it over the dataset
    once (2N_below / epochs per visit, per trained token). Averaged over visits of equal token counts.
    """
    per_block = _matmul_params(m, blocks)
    n = sum(per_block)
    store = 0.0
    for k, own in enumerate(per_block):
        below, above = sum(per_block[:k]), sum(per_block[k + 1:])
        store += 2 * (own + above) + 2 * above + 4 * own + 2 * below / epochs_per_visit
    return dict(full=6.0 * n, bcd_live=sum(visit_flops(m, blocks)) / len(blocks), bcd_store=store / len(blocks))


def visit_flops(m: ModelShape, blocks: list[LayerSpan]) -> list[float]:
    """Training FLOPs per token of a live visit of each block: forward 2N, backward 2N_above + 4N_k."""
    per_block = _matmul_params(m, blocks)
    return [2 * sum(per_block) + 2 * sum(per_block[k + 1:]) + 4 * own for k, own in enumerate(per_block)]


def _matmul_params(m: ModelShape, blocks: list[LayerSpan]) -> list[int]:
    """Per block, the matmul parameters a token runs through (an embedding lookup costs nothing)."""
    head = m.vocab * m.hidden
    return [m.span_params(b.start, b.stop, active=True) + (head if b.head else 0) for b in blocks]


def cost(m: ModelShape, settings: Settings, blocks: list[LayerSpan]) -> dict | None:
    """GPU-hours and dollars to train on `tokens` tokens: FLOPs / (peak x MFU), at the hourly price.

    GPU-hours do not depend on the number of GPUs (ideal scaling; pipeline bubbles neglected).
    """
    if not settings.tokens:
        return None
    gpu = GPUS.get(settings.gpu, {})
    peak = gpu.get("tflops_fp32" if settings.dtype == "float32" else "tflops_bf16")
    price = settings.price_per_hour if settings.price_per_hour is not None else gpu.get("price")
    if peak is None:
        return dict(note="no peak FLOPs for a --gpu-mem GPU; give --gpu for the cost estimate")
    out = dict(peak_tflops=peak, mfu=settings.mfu, price_per_hour=price)
    for mode, flops in flops_per_token(m, blocks, settings.epochs_per_visit).items():
        hours = settings.tokens * flops / (peak * 1e12 * settings.mfu) / 3600
        out[mode] = dict(gpu_hours=hours, dollars=None if price is None else hours * price)
    return out
