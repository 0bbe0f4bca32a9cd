"""Partitions: the model's units (embed, layers, head) grouped into contiguous blocks trained one at a time."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction
from typing import TYPE_CHECKING

from preinfer.errors import UsageError

if TYPE_CHECKING:  # annotations only: the planner imports this module without torch
    from torch import nn

    from preinfer.metrics import BudgetPlanRecord
    from preinfer.staged import StagedModel, Unit


@dataclass(frozen=True)
class Block:
    """Consecutive units trained together. `start` is the boundary the block's input comes from:
    its first layer, 0 when it holds the embedding, `num_layers` for a block that holds only the head."""

    index: int
    units: tuple[str, ...]
    start: int
    stop: int
    params: tuple[nn.Parameter, ...]
    active_params: int  # parameters one token runs through: each fused expert tensor counts top_k / num_experts

    @property
    def has_embed(self) -> bool:
        return "embed" in self.units

    @property
    def has_head(self) -> bool:
        return "head" in self.units

    @property
    def num_params(self) -> int:
        return sum(p.numel() for p in self.params)

    @property
    def label(self) -> str:
        parts = ["embed"] if self.has_embed else []
        if self.stop - self.start == 1:
            parts.append(f"layer {self.start}")
        elif self.stop > self.start:
            parts.append(f"layers {self.start}-{self.stop - 1}")
        return "+".join(parts + (["head"] if self.has_head else []))


@dataclass(frozen=True)
class Partition:
    blocks: tuple[Block, ...]
    total_params: int
    active_params: int
    tied: tuple[tuple[str, int | None], ...]  # (names of a tied tensor, its block; None: frozen below the blocks)
    budget: BudgetPlanRecord | None = None  # the memory budget plan that chose the blocks (--ufp auto), if any

    def __len__(self) -> int:
        return len(self.blocks)

    def report(self) -> str:
        """A human-readable table of blocks, their parameter share (every expert counted), the parameters a token
        runs through where that differs (mixture of experts), and who owns each tied weight."""
        sparse = self.active_params != self.total_params
        active = f" ({self.active_params:,} active per token)" if sparse else ""
        lines = [f"{len(self.blocks)} blocks over {self.total_params:,} parameters{active}"]
        for b in self.blocks:
            share = b.num_params / self.total_params
            line = f"  block {b.index}: {b.label:<28} {b.num_params:>12,} params  UFP {share:.3f}"
            lines.append(line + (f"  {b.active_params:>12,} active per token" if sparse else ""))
        lines += [
            f"  tied weight {names} is owned by block {owner}" if owner is not None
            else f"  tied weight {names} belongs to the frozen prefix: it stays frozen in every block"
            for names, owner in self.tied
        ]
        return "\n".join(lines)


def parse_ufp(text: str) -> float:
    """`1/3`, `0.25` or `1` -> a float in (0, 1]."""
    try:
        value = float(Fraction(text.strip()))
    except (ValueError, ZeroDivisionError):
        raise UsageError(f"--ufp '{text}' is not a number or fraction such as 1/3, nor auto") from None
    if not 0 < value <= 1:
        raise UsageError(f"--ufp {text} is outside (0, 1]")
    return value


def parse_ranges(text: str, num_layers: int, first: int = 0, cover: bool = True) -> list[tuple[int, int]]:
    """`0-3,4-7` (inclusive layer ranges) -> [(0, 4), (4, 8)] within layers `first`..; with `cover` they must
    cover those layers exactly once."""
    ranges = []
    for part in text.split(","):
        head, sep, tail = part.strip().partition("-")
        try:
            lo, hi = int(head), int(tail if sep else head)
        except ValueError:
            raise UsageError(f"--ranges part '{part}' is not a layer range such as 0-3") from None
        if lo > hi:
            raise UsageError(f"--ranges part '{part}' ends before it starts")
        if lo < first or hi >= num_layers:
            raise UsageError(f"layer range '{part}' is outside layers {first}-{num_layers - 1}")
        ranges.append((lo, hi + 1))
    ranges.sort()
    if not cover:
        return ranges
    expected = first
    for lo, hi in ranges:
        if lo < expected:
            raise UsageError(f"--ranges '{text}': layer {lo} is in two ranges")
        if lo > expected:
            raise UsageError(f"--ranges '{text}' skips layer {expected}")
        expected = hi
    if expected != num_layers:
        raise UsageError(f"--ranges '{text}' must cover layers {first}-{num_layers - 1}; it ends at layer {expected - 1}")
    return ranges


def minimax_cut(n: int, parts: int, cost: Callable[[int, int, int], float]) -> list[tuple[int, int]]:
    """Cut [0, n) into `parts` non-empty contiguous runs [lo, hi) minimising the largest `cost(j, lo, hi)` of run j
    (dynamic programming over every cut)."""
    # best[j][i]: the smallest largest cost of cutting [0, i) into runs 0..j-1; cut[j][i]: where the last starts.
    best = [[math.inf] * (n + 1) for _ in range(parts + 1)]
    cut = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0
    for j in range(1, parts + 1):
        for i in range(j, n - (parts - j) + 1):
            for k in range(j - 1, i):
                if best[j - 1][k] >= best[j][i]:  # no cost of run j - 1 makes this cut better (and inf: none)
                    continue
                value = max(best[j - 1][k], cost(j - 1, k, i))
                if value < best[j][i]:
                    best[j][i], cut[j][i] = value, k
    bounds, i = [], n
    for j in range(parts, 0, -1):
        bounds.append((cut[j][i], i))
        i = cut[j][i]
    return bounds[::-1]


def balanced_ranges(sizes: list[int], parts: int) -> list[tuple[int, int]]:
    """Split `sizes` into `parts` contiguous runs minimising the largest run's sum."""
    prefix = [0]
    for size in sizes:
        prefix.append(prefix[-1] + size)
    return minimax_cut(len(sizes), parts, lambda _, lo, hi: prefix[hi] - prefix[lo])


def make_partition(
    staged: StagedModel,
    ufp: float | None = None,
    num_blocks: int | None = None,
    ranges: str | None = None,
    separate_ends: bool = False,
    first_layer: int = 0,
) -> Partition:
    """Blocks by UFP (about that fraction of the parameters each), by count, or by explicit layer ranges.

    The embedding joins the first block and the head the last unless `separate_ends`, which makes them blocks
    of their own (then `ufp`/`num_blocks` split the layers alone). A tied weight belongs to the first block
    that uses it (GPT-2's `wte`/`lm_head`: the block holding the embedding). With `first_layer = k > 0` only
    layers >= k and the head are partitioned (training from a store at boundary k): everything below, a tied
    embedding included, stays frozen.
    """
    if sum(x is not None for x in (ufp, num_blocks, ranges)) != 1:
        raise UsageError("give exactly one of --ufp, --blocks, --ranges")
    units = staged.units()
    owned = _owned_params(units)
    sizes = [sum(p.numel() for p in params) for params in owned]
    L, lo = staged.num_layers, first_layer
    if ranges is not None:
        layer_ranges = parse_ranges(ranges, L, first=lo)
    elif lo == L:
        layer_ranges = []
    else:
        count = num_blocks if num_blocks is not None else math.ceil(1 / ufp - 1e-9)
        if not 1 <= count <= L - lo:
            raise UsageError(f"cannot make {count} blocks from {L - lo} layers (blocks are whole layers)")
        layer_sizes = sizes[lo + 1 : L + 1]
        if not separate_ends:
            layer_sizes[0] += sizes[0] if lo == 0 else 0
            layer_sizes[-1] += sizes[-1]
        layer_ranges = [(a + lo, b + lo) for a, b in balanced_ranges(layer_sizes, count)]
    groups = [list(range(a + 1, b + 1)) for a, b in layer_ranges]
    if separate_ends or not groups:
        groups = ([[0]] if lo == 0 else []) + groups + [[L + 1]]
    else:
        if lo == 0:
            groups[0].insert(0, 0)
        groups[-1].append(L + 1)
    shares = staged.expert_shares()
    blocks = tuple(_block(index, group, units, owned, L, shares) for index, group in enumerate(groups))
    block_of_unit = {unit: b for b, group in enumerate(groups) for unit in group}
    total = sum(sizes[u] for group in groups for u in group)
    active = sum(b.active_params for b in blocks)
    return Partition(blocks, total, active, _tied(staged.model, units, block_of_unit))


def _block(
    index: int, group: list[int], units: list[Unit], owned: list[list[nn.Parameter]], L: int, shares: dict[int, float]
) -> Block:
    layers = [u - 1 for u in group if 1 <= u <= L]
    if 0 in group:
        start = 0
    else:
        start = layers[0] if layers else L
    stop = layers[-1] + 1 if layers else start
    params = tuple(p for u in group for p in owned[u])
    active = round(sum(p.numel() * shares.get(id(p), 1.0) for p in params))
    return Block(index, tuple(units[u].name for u in group), start, stop, params, active)


def _owned_params(units: list[Unit]) -> list[list[nn.Parameter]]:
    """Each unit's parameters, a shared (tied) tensor listed only under the first unit that uses it."""
    seen: set[int] = set()
    owned = []
    for unit in units:
        mine = []
        for p in unit.parameters():
            if id(p) not in seen:
                seen.add(id(p))
                mine.append(p)
        owned.append(mine)
    return owned


def _tied(model: nn.Module, units: list[Unit], block_of_unit: dict[int, int]) -> tuple[tuple[str, int | None], ...]:
    """For each tensor used by more than one unit: its names and the block that owns (trains) it."""
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    first_unit: dict[int, int] = {}
    users: dict[int, set[int]] = {}
    for u, unit in enumerate(units):
        for p in unit.parameters():
            first_unit.setdefault(id(p), u)
            users.setdefault(id(p), set()).add(u)
    return tuple(
        (" = ".join(names.get(pid, ["?"])), block_of_unit.get(first_unit[pid]))
        for pid, used_by in users.items()
        if len(used_by) > 1
    )
