"""The layout of a run directory: `RunDir` is the one place that names its files (config.toml, inputs.json,
metrics.jsonl, checkpoint/, replicas/ (the checkpoints of data-parallel replicas 1, 2, ...), export/, loss.png,
summary.json, stores/, masters/, and the trackers' tensorboard/, mlruns/ and wandb/); everything else asks it for
their paths."""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path

from preinfer.atomic_write import write_atomically
from preinfer.checkpoint import WEIGHTS, newest_checkpoint

# The entries a run writes in its directory: its files, and its directories (the checkpoint's with a save's two
# siblings, and the trackers' folders).
FILES = frozenset({"config.toml", "inputs.json", "metrics.jsonl", "loss.png", "summary.json"})
CHECKPOINTS = ("checkpoint", "checkpoint.tmp", "checkpoint.old")
TRACKER_DIRS = {"tensorboard": "tensorboard", "mlflow": "mlruns", "wandb": "wandb"}  # by tracker name
DIRECTORIES = frozenset({*CHECKPOINTS, "replicas", "export", "stores", "masters", *TRACKER_DIRS.values()})
ENTRIES = FILES | DIRECTORIES


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
    masters: Path  # masters/: with --masters disk, the files of the blocks the run has trained

    def __init__(self, path: str | Path):
        root = Path(path)
        layout = dict(path=root, config=root / "config.toml", metrics=root / "metrics.jsonl",
                      checkpoint=root / "checkpoint", checkpoint_weights=root / "checkpoint" / WEIGHTS,
                      export=root / "export", loss_plot=root / "loss.png", summary=root / "summary.json",
                      stores=root / "stores", inputs=root / "inputs.json", masters=root / "masters")
        for name, value in layout.items():
            object.__setattr__(self, name, value)

    def replica_checkpoint(self, replica: int) -> Path:
        """The checkpoint of data-parallel replica `replica` (1, 2, ...; replica 0's is `checkpoint`)."""
        return self.path / "replicas" / f"checkpoint-{replica}"

    def tracker_dir(self, name: str) -> Path:
        """The folder tracker `name` (`--report-to`: tensorboard, mlflow, wandb) reports into."""
        return self.path / TRACKER_DIRS[name]

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

    def misplaced_entries(self) -> list[str]:
        """The entries a run writes whose place holds something else (a symlink, a fifo, a file for a directory or
        a directory for a file), each as "'NAME' is WHAT"; the checkpoints' and the export's files too, since a run
        reads or writes through them."""
        if not self.path.is_dir():
            return []
        found = []
        for name in sorted(ENTRIES):
            kind = _kind(self.path / name)
            expected = "a directory" if name in DIRECTORIES else "a file"
            if kind is not None and kind != expected:
                found.append(f"{name!r} is {kind}, where a run keeps {expected}")
            elif kind == "a directory" and name in (*CHECKPOINTS, "export"):
                found += [f"{entry!r} is {what}, where a run keeps a file or a directory"
                          for entry, what in _odd_files(self.path, self.path / name)]
        return found

    def write_config(self, text: str) -> None:
        """Publish config.toml (`preinfer.atomic_write.write_atomically`)."""
        write_atomically(self.config, text)


def _kind(path: Path) -> str | None:
    """What is at `path` (not following a symlink), in words; None: nothing."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return None
    kinds = {"a symbolic link": stat.S_ISLNK, "a directory": stat.S_ISDIR, "a file": stat.S_ISREG,
             "a fifo": stat.S_ISFIFO, "a socket": stat.S_ISSOCK}
    return next((name for name, test in kinds.items() if test(mode)), "a device file")


def _odd_files(root: Path, directory: Path) -> list[tuple[str, str]]:
    """(path relative to `root`, what it is) of every entry under `directory` that is neither a file nor a
    directory (symlinks are not followed)."""
    found = []
    for parent, directories, files in os.walk(directory):
        for name in [*directories, *files]:
            kind = _kind(Path(parent) / name)
            if kind not in ("a file", "a directory"):
                found.append(((Path(parent) / name).relative_to(root).as_posix(), kind))
    return sorted(found)
