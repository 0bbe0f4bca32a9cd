"""Runs of consecutive layers (`LayerSpan`: a block, or a pipeline stage) and the partition of a model into blocks."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from preinfer.errors import UsageError
from preinfer.memory.shapes import ModelShape
from preinfer.partition import Partition, balanced_ranges


@dataclass(frozen=True)
class LayerSpan:
    """Layers [start, stop) as the memory model prices them (a block, or a pipeline stage), and whether the span
    holds the embedding (`embed`: the first one) and the final norm and head (`head`: the last one)."""

    start: int
    stop: int
    embed: bool
    head: bool


def block_spans(blocks: Partition) -> list[LayerSpan]:
    """A run's partition (`preinfer.partition.Partition`) as the memory model prices its blocks."""
    return [LayerSpan(b.start, b.stop, b.has_embed, b.has_head) for b in blocks.blocks]


def partition(m: ModelShape, blocks: int, separate_ends: bool = False) -> list[LayerSpan]:
    """`blocks` contiguous blocks of layers balanced by parameter count, the embedding joining the first and the
    head the last, or with `separate_ends` each in a block of its own before and after them: the same blocks
    `preinfer bcd` trains (`preinfer.partition.make_partition`)."""
    if not 1 <= blocks <= m.layers:
        raise UsageError(f"number of blocks must be between 1 and the model's {m.layers} layers, got {blocks}")
    sizes = [m.layer_params(layer) for layer in range(m.layers)]
    if not separate_ends:
        sizes[0] += m.embed_params()
        sizes[-1] += m.head_params()
    ranges = _balanced_ranges(tuple(sizes), blocks)
    if separate_ends:
        return [LayerSpan(0, 0, True, False), *(LayerSpan(lo, hi, False, False) for lo, hi in ranges),
                LayerSpan(m.layers, m.layers, False, True)]
    return [LayerSpan(lo, hi, k == 0, k == blocks - 1) for k, (lo, hi) in enumerate(ranges)]


@functools.lru_cache(maxsize=4096)
def _balanced_ranges(sizes: tuple[int, ...], blocks: int) -> tuple[tuple[int, int], ...]:
    """`balanced_ranges`, remembered: the automatic choice asks for the same split at every pipeline degree."""
    return tuple(balanced_ranges(list(sizes), blocks))


def blocks_for_ufp(ufp: float, layers: int) -> int:
    """Number of blocks for an unfrozen parameter fraction: ceil(1/UFP) (1/3 -> 3), at most one per layer."""
    if not 0 < ufp <= 1:
        raise UsageError(f"UFP must be in (0, 1], got {ufp:g}")
    return min(layers, math.ceil(1 / ufp - 1e-9))


def block_params(m: ModelShape, block: LayerSpan) -> int:
    """Parameters of one block (a tied LM head belongs to the embedding's block)."""
    return (m.span_params(block.start, block.stop) + (m.embed_params() if block.embed else 0)
            + (m.head_params() if block.head else 0))
