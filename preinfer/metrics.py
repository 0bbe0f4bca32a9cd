"""The run's metrics log (JSON lines) and its loss plot."""

from __future__ import annotations

import json
from pathlib import Path


class MetricsLog:
    """Appends one JSON object per line; a None path discards (non-zero ranks, tests)."""

    def __init__(self, path: Path | None):
        self.path = path
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)

    def write(self, record: dict) -> None:
        if self.path is not None:
            with self.path.open("a") as f:
                f.write(json.dumps(record) + "\n")


def read_metrics(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def plot_losses(runs: dict[str, list[dict]], out: Path, title: str = "") -> None:
    """Training loss (smoothed) and eval loss against tokens, one colour per run; the first run's visits are
    shaded by block."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5))
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for index, (name, records) in enumerate(runs.items()):
        colour = colours[index % len(colours)]
        steps = [r for r in records if r["kind"] == "step"]
        visits = [r for r in records if r["kind"] == "visit"]
        if index == 0:
            _shade_visits(ax, steps, colours)
        ax.plot([r["tokens"] for r in steps], _smooth([r["loss"] for r in steps]), color=colour, alpha=0.8,
                label=f"{name}: training loss (smoothed)")
        ax.plot([r["tokens"] for r in visits], [r["eval_loss"] for r in visits], "o--", color=colour,
                label=f"{name}: eval loss after each visit")
    ax.set_xlabel("tokens")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title(title or "BCD training", pad=14)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def _shade_visits(ax, steps: list[dict], colours: list[str]) -> None:
    start = 0
    for i, r in enumerate(steps):
        last = i + 1 == len(steps) or steps[i + 1]["block"] != r["block"] or steps[i + 1]["sweep"] != r["sweep"]
        if last:
            lo = steps[start - 1]["tokens"] if start else 0
            ax.axvspan(lo, r["tokens"], color=colours[r["block"] % len(colours)], alpha=0.08, lw=0)
            ax.text((lo + r["tokens"]) / 2, 1.0, f"b{r['block']}", transform=ax.get_xaxis_transform(),
                    ha="center", va="bottom", fontsize=7)
            start = i + 1


def _smooth(values: list[float], weight: float = 0.9) -> list[float]:
    out, current = [], None
    for v in values:
        current = v if current is None else weight * current + (1 - weight) * v
        out.append(current)
    return out
