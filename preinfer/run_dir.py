"""The layout of a run directory: `RunDir` is the one place that names its files (config.toml, metrics.jsonl,
checkpoint/, export/, loss.png, summary.json, stores/); everything else asks it for their paths."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from preinfer.checkpoint import WEIGHTS


@dataclass(frozen=True, init=False)
class RunDir:
    """A run directory at `path` (which need not exist yet) and the paths of its parts."""

    path: Path
    config: Path  # config.toml: the resolved config, written once every input has been checked
    metrics: Path  # metrics.jsonl: one record per line
    checkpoint: Path  # the latest checkpoint
    checkpoint_weights: Path  # its model weights (the resident tensors only, for a suffix-only run)
    export: Path  # the trained model and its tokenizer, a save_pretrained directory
    loss_plot: Path  # loss.png: training and eval loss against tokens
    summary: Path  # summary.json: the finished run's summary
    stores: Path  # where pre-inference keeps its stores by default

    def __init__(self, path: str | Path):
        root = Path(path)
        layout = dict(path=root, config=root / "config.toml", metrics=root / "metrics.jsonl",
                      checkpoint=root / "checkpoint", checkpoint_weights=root / "checkpoint" / WEIGHTS,
                      export=root / "export", loss_plot=root / "loss.png", summary=root / "summary.json",
                      stores=root / "stores")
        for name, value in layout.items():
            object.__setattr__(self, name, value)

    def export_is_current(self) -> bool:
        """The export holds the checkpoint's weights (it was written after the latest checkpoint)."""
        config = self.export / "config.json"
        return self.is_resumable() and config.is_file() and (
            config.stat().st_mtime >= self.checkpoint_weights.stat().st_mtime)

    def holds_run(self) -> bool:
        """A run was started here (its config is written)."""
        return self.config.is_file()

    def is_resumable(self) -> bool:
        """A run with a checkpoint: its config and checkpoint weights exist."""
        return self.holds_run() and self.checkpoint_weights.is_file()
