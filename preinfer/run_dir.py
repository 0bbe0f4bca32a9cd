"""The layout of a run directory: the one place that names its files.

    config.toml     the run's resolved configuration (written before training starts)
    metrics.jsonl   one JSON record per line (see `preinfer.metrics`)
    checkpoint/     the latest checkpoint (weights, optimizer states, trainer state)
    export/         the trained model as a save_pretrained directory, with its tokenizer
    loss.png        training and eval loss against tokens
    summary.json    the finished run's summary
    stores/         pre-inference's stores of boundary states, unless `store_dir` puts them elsewhere
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from preinfer.checkpoint import WEIGHTS


@dataclass(frozen=True)
class RunDir:
    """A run directory at `path` (which need not exist yet)."""

    path: Path

    def __init__(self, path: str | Path):
        object.__setattr__(self, "path", Path(path))

    @property
    def config(self) -> Path:
        return self.path / "config.toml"

    @property
    def metrics(self) -> Path:
        return self.path / "metrics.jsonl"

    @property
    def checkpoint(self) -> Path:
        return self.path / "checkpoint"

    @property
    def checkpoint_weights(self) -> Path:
        """The model weights of the latest checkpoint (the resident tensors only for a suffix-only run)."""
        return self.checkpoint / WEIGHTS

    @property
    def export(self) -> Path:
        return self.path / "export"

    @property
    def loss_plot(self) -> Path:
        return self.path / "loss.png"

    @property
    def summary(self) -> Path:
        return self.path / "summary.json"

    @property
    def stores(self) -> Path:
        """Where pre-inference keeps its stores by default."""
        return self.path / "stores"

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
