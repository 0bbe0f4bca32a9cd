"""Eval-loss curves: where a run's curve plateaus (bench.quality's --until-plateau, bench.orders' target)."""

from __future__ import annotations


def plateau_point(curve: list[dict], rel: float, window: int) -> dict | None:
    """The first eval point after which the best eval loss improves by less than `rel` (relative) over the next
    `window` evaluations; None if the curve still improves at its end."""
    for i in range(len(curve) - window):
        best_now = min(c["eval_loss"] for c in curve[: i + 1])
        best_later = min(c["eval_loss"] for c in curve[: i + 1 + window])
        if best_later > best_now * (1 - rel):
            return curve[i]
    return None
