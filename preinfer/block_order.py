"""Block orders: which block each visit of a sweep trains.

The fixed orders (`sweep_order`) are functions of the sweep number and the seed. The importance orders
(`importance_sweep`) are functions of each block's score, measured at the sweep's start (`preinfer.importance`),
and of the sweeps in which each block was last visited: a sweep visits the blocks scoring at least the mean score,
plus every block the floor makes due, in descending score order; `importance-cached` takes the same blocks in
ascending order (which lets each store be rolled forward to the next) unless their scores spread by more than the
margin.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from preinfer.config.choices import IMPORTANCE_ORDERS, ORDERS
from preinfer.errors import UsageError


def parse_fixed_order(text: str, num_blocks: int) -> list[int]:
    """`2,0,1` -> [2, 0, 1]; must name every block exactly once."""
    try:
        order = [int(part) for part in text.split(",")]
    except ValueError:
        raise UsageError(f"--fixed-order '{text}' is not a comma-separated list of block numbers") from None
    if sorted(order) != list(range(num_blocks)):
        raise UsageError(f"--fixed-order '{text}' must name each of blocks 0-{num_blocks - 1} exactly once")
    return order


def sweep_order(
    order: str,
    num_blocks: int,
    sweep: int,
    seed: int = 0,
    start_block: int | None = None,
    fixed: list[int] | None = None,
) -> list[int]:
    """The blocks visited in sweep number `sweep`, every block once, beginning with `start_block` if given.

    ascending / descending / fixed orders are rotated to begin at the start block; random reshuffles every
    sweep (seeded by `seed` and the sweep number) and then moves the start block to the front.
    """
    if start_block is not None and not 0 <= start_block < num_blocks:
        raise UsageError(f"--start-block {start_block} is outside blocks 0-{num_blocks - 1}")
    if order == "ascending":
        base = list(range(num_blocks))
    elif order == "descending":
        base = list(range(num_blocks - 1, -1, -1))
    elif order == "fixed":
        if fixed is None:
            raise UsageError("--order fixed needs --fixed-order, e.g. 2,0,1")
        base = list(fixed)
    elif order == "random":
        base = list(range(num_blocks))
        random.Random(f"{seed}:{sweep}").shuffle(base)
        if start_block is None:
            return base
        base.remove(start_block)
        return [start_block, *base]
    elif order in IMPORTANCE_ORDERS:
        raise UsageError(f"--order {order} is measured by the bcd trainer (`preinfer bcd`, `preinfer train`) at each "
                         f"sweep's start; choose one of {', '.join(o for o in ORDERS if o not in IMPORTANCE_ORDERS)}")
    else:
        raise UsageError(f"--order '{order}' is not one of {', '.join(ORDERS)}")
    at = 0 if start_block is None else base.index(start_block)
    return base[at:] + base[:at]


@dataclass(frozen=True)
class ImportanceSweep:
    """The visits of one sweep of an importance order, and why."""

    order: list[int]  # the blocks visited, in order
    chosen: str  # "importance" (descending score) or "ascending" (importance-cached, scores within the margin)
    spread: float  # (max - min) / max of the visited blocks' scores; 0 when the max is 0
    due: list[int]  # blocks visited because the floor made them due, whatever their score


def importance_sweep(scores: list[float], last_visits: list[int], sweep: int, floor: int, cached: bool = False,
                     margin: float = 0.0) -> ImportanceSweep:
    """Sweep `sweep` of an importance order: the blocks whose score is at least the mean score, plus every block
    not visited in the last `floor - 1` sweeps (`last_visits[b]`: the last sweep block b was visited in, -1 for
    none), so that each block is visited at least once in any `floor` consecutive sweeps. They are taken in
    descending score (ties by block index); with `cached`, in ascending block order when their scores' spread is at
    most `margin`."""
    mean = sum(scores) / len(scores)
    due = [b for b in range(len(scores)) if sweep - last_visits[b] >= floor]
    visited = sorted({b for b, score in enumerate(scores) if score >= mean} | set(due),
                     key=lambda b: (-scores[b], b))
    top = max(scores[b] for b in visited)
    spread = (top - min(scores[b] for b in visited)) / top if top > 0 else 0.0
    if cached and spread <= margin:
        return ImportanceSweep(sorted(visited), "ascending", spread, due)
    return ImportanceSweep(visited, "importance", spread, due)
