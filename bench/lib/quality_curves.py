"""bench.quality's analysis of the eval curves: each method at the budget, against full Adam and the paper, the
precisions against fp32, and the plot."""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from bench.lib.curves import plateau_point
from bench.lib.quality_runs import method_precision

TARGET_REL = 0.03  # BCD-Adam's final eval loss within 3% of full Adam's
PRECISION_REL = {"bf16-mixed": 0.01, "fp16-mixed": 0.02}  # final eval loss against the same method in fp32
PAPER = dict(ppl_full_adam=6.59, ppl_bcd_adam=6.62, epochs_ratio_ufp_1_3=2.2)


def at_budget(curve: list[dict], tokens: int) -> dict:
    """The last eval point at or before `tokens`."""
    return [c for c in curve if c["tokens"] <= tokens][-1]


def first_reaching(curve: list[dict], loss: float) -> dict | None:
    """The first eval point whose loss is at or below `loss`, linearly interpolated in tokens, epochs, wall."""
    for before, after in zip(curve, curve[1:]):
        if after["eval_loss"] <= loss:
            span = before["eval_loss"] - after["eval_loss"]
            f = 1.0 if span <= 0 else min(1.0, max(0.0, (before["eval_loss"] - loss) / span))
            return {k: before[k] + f * (after[k] - before[k]) for k in ("tokens", "epochs", "train_wall_s")}
    return None


def trend(curve: list[dict], points: int = 4) -> dict | None:
    """Least-squares fit of eval loss = a + b * log(tokens) over the last `points` evaluations."""
    tail = [c for c in curve if c["tokens"] > 0][-points:]
    if len(tail) < 3:
        return None
    xs = [math.log(c["tokens"]) for c in tail]
    ys = [c["eval_loss"] for c in tail]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    var = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var if var else 0.0
    return dict(intercept=my - slope * mx, slope_per_log_token=slope)


def tokens_to_reach(fit: dict | None, loss: float) -> float | None:
    """Tokens at which a fitted log trend reaches `loss` (None when the trend does not fall)."""
    if fit is None or fit["slope_per_log_token"] >= 0:
        return None
    return math.exp((loss - fit["intercept"]) / fit["slope_per_log_token"])


def summarise(runs: dict[str, dict], budget_tokens: int, args: argparse.Namespace) -> dict:
    """Per method: equal-budget (or best, --until-plateau) figures, best loss, plateau; and the epochs ratio
    against the paper's 2.2x."""
    rows = {}
    for name, run in runs.items():
        curve = run["curve"]
        best = min((c for c in curve if c["tokens"] <= budget_tokens), key=lambda c: c["eval_loss"])
        end = best if args.until_plateau else at_budget(curve, budget_tokens)
        plateau = plateau_point(curve, args.plateau_rel, args.plateau_window)
        rows[name] = dict(
            final_eval_loss=end["eval_loss"], final_ppl=math.exp(end["eval_loss"]), tokens=end["tokens"],
            epochs=end["epochs"], train_wall_s=end["train_wall_s"],
            best_eval_loss=best["eval_loss"], best_at_tokens=best["tokens"], best_at_epochs=best["epochs"],
            plateau=plateau, run_tokens=run["tokens"], run_epochs=run["tokens"] / run["tokens_per_epoch"],
            run_final_eval_loss=curve[-1]["eval_loss"], trend_last_4=trend(curve),
            run_train_wall_s=run["train_wall_s"], eval_s=run["eval_s"],
            peak_tracked_bytes=run.get("peak_tracked_bytes"),
        )
    full = rows["full-adam"]
    target = full["final_eval_loss"]
    for name, row in rows.items():
        row["rel_to_full"] = row["final_eval_loss"] / target - 1
        reach = first_reaching(runs[name]["curve"], target)
        row["reach_full_final"] = reach
        if reach is None and name != "full-adam":
            fit = trend(runs[name]["curve"])
            estimate = tokens_to_reach(fit, target)
            tokens_per_epoch = runs[name]["tokens_per_epoch"]
            row["reach_full_final_extrapolated_epochs"] = None if estimate is None else estimate / tokens_per_epoch
    bcd = rows.get("bcd-adam")
    epochs_ratio = None
    if bcd is not None:
        reach = bcd["reach_full_final"]
        epochs_ratio = dict(
            full_adam_epochs=full["epochs"],
            bcd_adam_epochs_to_full_final=reach["epochs"] if reach else None,
            ratio=(reach["epochs"] / full["epochs"]) if reach else None,
            extrapolated_ratio=(bcd.get("reach_full_final_extrapolated_epochs") or math.nan) / full["epochs"]
            if not reach else None,
            paper=PAPER["epochs_ratio_ufp_1_3"],
        )
        if bcd["plateau"] and full["plateau"]:
            full_at, bcd_at = full["plateau"]["epochs"], bcd["plateau"]["epochs"]
            epochs_ratio["plateau_epochs"] = dict(full_adam=full_at, bcd_adam=bcd_at,
                                                  ratio=bcd_at / full_at if full_at else None)
        target_check = dict(rel=bcd["rel_to_full"], limit=TARGET_REL, holds=bcd["rel_to_full"] <= TARGET_REL,
                            best_rel=bcd["best_eval_loss"] / full["best_eval_loss"] - 1)
    else:
        target_check = None
    return dict(rows=rows, epochs_ratio=epochs_ratio, target=target_check)


def compare_precisions(runs: dict[str, dict], budget_tokens: int) -> dict:
    """Each METHOD@PRECISION run against METHOD in fp32 at the same budget: relative final eval loss, its limit,
    and the steps the loss scaler skipped."""
    rows = {}
    for key, run in runs.items():
        name, precision = method_precision(key)
        if precision == "fp32" or name not in runs:
            continue
        ours, fp32 = (at_budget(r["curve"], budget_tokens)["eval_loss"] for r in (run, runs[name]))
        rel = ours / fp32 - 1
        rows[key] = dict(method=name, precision=precision, final_eval_loss=ours, fp32_final_eval_loss=fp32,
                         rel_to_fp32=rel, limit=PRECISION_REL[precision], holds=abs(rel) <= PRECISION_REL[precision],
                         steps=run["steps"], skipped_steps=run["skipped_steps"],
                         train_wall_s=run["train_wall_s"], fp32_train_wall_s=runs[name]["train_wall_s"])
    return rows


def plot(runs: dict[str, dict], budget_tokens: int, out: Path, title: str, until_plateau: bool) -> None:
    """Eval loss against tokens for every method, the budget and full Adam's final (or best) loss marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for name, run in runs.items():
        curve = [c for c in run["curve"] if c["tokens"] > 0]
        ax.plot([c["tokens"] for c in curve], [c["eval_loss"] for c in curve], "o-", ms=3, label=name)
    full_curve = runs["full-adam"]["curve"]
    if until_plateau:
        full = min(c["eval_loss"] for c in full_curve)
        ax.axhline(full, color="grey", ls=":", lw=1, label=f"full Adam best ({full:.3f})")
    else:
        full = at_budget(full_curve, budget_tokens)["eval_loss"]
        ax.axhline(full, color="grey", ls=":", lw=1, label=f"full Adam final ({full:.3f})")
        ax.axvline(budget_tokens, color="grey", ls="--", lw=1, label="equal token budget")
    ax.set_xlabel("training tokens")
    ax.set_ylabel("eval loss (nats/token)")
    ax.set_title(title)
    losses = [c["eval_loss"] for r in runs.values() for c in r["curve"] if c["tokens"] > 0]
    ax.set_ylim(min(losses) - 0.05, min(max(losses), full + 1.5))
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)

