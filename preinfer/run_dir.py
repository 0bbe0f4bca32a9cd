"""The layout of a run directory: `RunDir` is the one place that names its files (config.toml, inputs.json,
metrics.jsonl, checkpoint/, export/, loss.png, summary.json, stores/); everything else asks it for their paths."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from preinfer.checkpoint import WEIGHTS, newest_checkpoint

# The entries a run writes in its directory (the checkpoint's with a save's two siblings).
ENTRIES = frozenset({"config.toml", "metrics.jsonl", "checkpoint", "checkpoint.tmp", "checkpoint.old", "export",
                     "loss.png", "summary.json", "stores", "inputs.json"})


@dataclass(frozen=True, init=False)
class RunDir:
    """A run directory at `path` (which need not exist yet) and the paths of its parts."""

    path: Path
    config: Path  # config.toml: the resolved config, written once every input has been checked
    inputs: Path  # inputs.json: the fingerprints of what the run trains on, written with the config
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
                      stores=root / "stores", inputs=root / "inputs.json")
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

    def has_checkpoint(self) -> bool:
        """A checkpoint to resume from: a complete one (also one a killed save left beside `checkpoint/`), or a
        pipeline run's directory of stage checkpoints."""
        return self.checkpoint.is_dir() or newest_checkpoint(self.checkpoint) is not None

    def failed_start(self) -> bool:
        """A run that stopped before its first checkpoint (its config, maybe a metrics log, nothing else of note):
        a rerun may start it afresh."""
        later = (self.checkpoint, self.checkpoint.with_name("checkpoint.tmp"),
                 self.checkpoint.with_name("checkpoint.old"), self.export, self.summary)
        return self.holds_run() and not any(p.exists() for p in later)

    def foreign_entries(self) -> list[str]:
        """The entries of the directory a run does not write (every entry, where no run was started): a run
        refuses a directory holding any."""
        if not self.path.is_dir():
            return []
        names = sorted(p.name for p in self.path.iterdir() if not p.name.startswith("."))
        return [n for n in names if n not in ENTRIES] if self.holds_run() else names

    def write_config(self, text: str) -> None:
        """Publish config.toml (see `publish`)."""
        self.publish(self.config, text)

    def publish(self, path: Path, text: str) -> None:
        """Publish one of the run's files atomically: written beside, made durable, renamed into place (a failed
        write leaves no partial file)."""
        temporary = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        try:
            with temporary.open("w") as f:
                f.write(text)
                f.flush()
                os.fsync(f.fileno())
            os.replace(temporary, path)
        finally:
            temporary.unlink(missing_ok=True)
