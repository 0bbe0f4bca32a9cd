"""Block orders: which block each visit of a sweep trains."""

from __future__ import annotations

import random

from preinfer.errors import UsageError

ORDERS = ("ascending", "descending", "random", "fixed")


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
    else:
        raise UsageError(f"--order '{order}' is not one of {', '.join(ORDERS)}")
    at = 0 if start_block is None else base.index(start_block)
    return base[at:] + base[:at]
