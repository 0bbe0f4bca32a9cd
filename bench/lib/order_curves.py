"""bench.orders' analysis, pure functions of the eval curves: epochs, full Adam's target once its plateau is
seen, each row's time and epochs to it, the best row and the UFP table's rows."""

from __future__ import annotations

from bench.lib.curves import plateau_point

TARGETS = dict(x_time=0.6, x_epochs=1.15, best_vs_full_pct=0.5)


def add_epochs(curve: list[dict], epoch_steps: float) -> list[dict]:
    """The curve with each point's epochs: its steps over an epoch's."""
    return [dict(point, epochs=point["step"] / epoch_steps) for point in curve]


def first_reaching(curve: list[dict], loss: float) -> dict | None:
    """The first point whose eval loss is at or below `loss`; None if none is."""
    return next((point for point in curve if point["eval_loss"] <= loss), None)


def plateau(curve: list[dict], rel: float, window: int) -> tuple[int | None, float]:
    """The index of the curve's plateau point (None while it still improves) and its best eval loss once the
    plateau is seen: the best up to the plateau point plus `window` evaluations, or of the whole curve."""
    point = plateau_point(curve, rel, window)
    index = None if point is None else next(i for i, p in enumerate(curve) if p is point)
    seen = curve if index is None else curve[: index + window + 1]
    return index, min(p["eval_loss"] for p in seen)


def to_target(curve: list[dict], target: float) -> dict:
    """Training time and epochs of the first point at or below `target` (None for both if none is)."""
    reached = first_reaching(curve, target)
    if reached is None:
        return dict(time_to_target=None, epochs_to_target=None)
    return dict(time_to_target=reached["train_s"], epochs_to_target=reached["epochs"])


def full_summary(result: dict, rel: float, window: int) -> dict:
    """Full Adam's row: its plateau, the target, its time and epochs to it, its best eval loss."""
    curve = result["curve"]
    index, target = plateau(curve, rel, window)
    return dict(result, row="full", target=target, plateau_index=index,
                plateau_epochs=None if index is None else curve[index]["epochs"],
                best_eval_loss=min(p["eval_loss"] for p in curve), **to_target(curve, target))


def order_summary(name: str, result: dict, full: dict, rel: float, window: int) -> dict:
    """A BCD row against full Adam: time and epochs to the target and their ratios, best eval loss against full
    Adam's, its own plateau, and whether each goal holds."""
    curve = result["curve"]
    index, _ = plateau(curve, rel, window)
    best = min(p["eval_loss"] for p in curve)
    row = dict(result, row=name, best_eval_loss=best, best_vs_full_pct=100 * (best / full["best_eval_loss"] - 1),
               plateau_epochs=None if index is None else curve[index]["epochs"], **to_target(curve, full["target"]))
    for key, of in (("x_time", "time_to_target"), ("x_epochs", "epochs_to_target")):
        row[key] = None if row[of] is None else row[of] / full[of]
    row["holds"] = {key: row[key] is not None and row[key] <= limit for key, limit in TARGETS.items()}
    return row


def best_row(rows: list[dict], named: str | None) -> dict:
    """The row the UFP table is made at: `named`, else the smallest time to target, else the lowest best loss."""
    if named:
        return next(r for r in rows if r["row"] == named)
    reached = [r for r in rows if r["time_to_target"] is not None]
    if reached:
        return min(reached, key=lambda r: r["time_to_target"])
    return min(rows, key=lambda r: r["best_eval_loss"])


def ufp_row(ufp: str, row: dict, full: dict) -> dict:
    """A UFP table row: blocks, tracked peak (and over full Adam's), epochs to the target and to its plateau."""
    return dict(ufp=ufp, blocks=row["blocks"], tracked_peak_mib=row["tracked_peak"] / 2**20,
                peak_x_full=row["tracked_peak"] / full["tracked_peak"], epochs_to_target=row["epochs_to_target"],
                plateau_epochs=row["plateau_epochs"], best_eval_loss=row["best_eval_loss"],
                epochs=row["curve"][-1]["epochs"])
