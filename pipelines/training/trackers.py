"""Experiment trackers (`--report-to tensorboard,wandb,mlflow`): every record `metrics.jsonl` holds (step, visit,
cache and plan records, `preinfer.metrics`) sent to each tracker named, from rank 0 only, as numbers under
`<kind>/<field>` at the run's step (a step record's own step; any other record the last step before it).

Offline by default: TensorBoard writes event files in `<out>/tensorboard`; W&B runs in offline mode (files in
`<out>/wandb`) unless the environment sets WANDB_MODE; MLflow logs to a file store in `<out>/mlruns` unless
MLFLOW_TRACKING_URI is set. Each tracker is an optional extra of the package (`pip install 'preinfer[tensorboard]'`);
one that is not installed is refused before the run directory is made, and so is a tracker folder that cannot be
written (a file in its place, a read-only directory)."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any, Protocol

from preinfer.config import Config, report_names
from preinfer.errors import UsageError, first_line
from preinfer.metrics import Record, StepRecord
from preinfer.run_dir import RunDir

# Each tracker's package (the module it imports), which its extra installs.
PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}


def tracker_names(report_to: str) -> list[str]:
    """The trackers of a `--report-to` value ("none": no tracker)."""
    return [name for name in report_names(report_to) if name != "none"]


def check_trackers(report_to: str, out: str | Path | None = None) -> None:
    """Refuse a tracker whose package is not installed, naming the extra that installs it, or whose folder in the
    run directory `out` cannot be written."""
    for name in tracker_names(report_to):
        if importlib.util.find_spec(PACKAGES[name]) is None:
            raise UsageError(f"--report-to {name}: the {PACKAGES[name]} package is not installed; install it with "
                             f"pip install 'preinfer[{name}]'")
        folder = RunDir(out).tracker_dir(name) if out is not None else None
        if folder is not None and folder.exists() and not (folder.is_dir() and os.access(folder, os.W_OK | os.X_OK)):
            raise _unwritable(name, folder, "a file" if not folder.is_dir() else "read-only")


def _unwritable(name: str, folder: Path, why: str) -> UsageError:
    return UsageError(f"--report-to {name}: {folder} cannot be written ({why}); make it a writable directory or "
                      f"remove it")


class Tracker(Protocol):
    def log(self, metrics: dict[str, float], step: int) -> None: ...

    def close(self) -> None: ...


class TensorBoard:
    """Event files in `<out>/tensorboard`."""

    def __init__(self, out: Path, config: Config):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(RunDir(out).tracker_dir("tensorboard")))

    def log(self, metrics: dict[str, float], step: int) -> None:
        for tag, value in metrics.items():
            self.writer.add_scalar(tag, value, step)

    def close(self) -> None:
        self.writer.close()


class WandB:
    """A W&B run, offline (files in `<out>/wandb`) unless WANDB_MODE says otherwise."""

    def __init__(self, out: Path, config: Config):
        import wandb

        mode = os.environ.get("WANDB_MODE", "offline")
        self.run = wandb.init(dir=str(out), mode=mode, project=os.environ.get("WANDB_PROJECT", "preinfer"),
                              name=out.name, config=config.to_dict())

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.run.log(metrics, step=step)

    def close(self) -> None:
        self.run.finish()


class MLflow:
    """An MLflow run in the experiment "preinfer" (MLFLOW_EXPERIMENT_NAME), in a file store at `<out>/mlruns` unless
    MLFLOW_TRACKING_URI names another. MLflow 3 keeps its file store in maintenance mode behind
    MLFLOW_ALLOW_FILE_STORE: a run that uses it sets that for its own process unless the environment does."""

    def __init__(self, out: Path, config: Config):
        uri = os.environ.get("MLFLOW_TRACKING_URI")
        if uri is None:
            uri = RunDir(out).tracker_dir("mlflow").resolve().as_uri()
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.client = mlflow_client(uri)
        name = os.environ.get("MLFLOW_EXPERIMENT_NAME", "preinfer")
        experiment = self.client.get_experiment_by_name(name)
        ident = experiment.experiment_id if experiment is not None else self.client.create_experiment(name)
        self.run_id = self.client.create_run(ident, run_name=out.name).info.run_id
        for section, entries in config.to_dict().items():
            for key, value in entries.items():
                if value is not None:
                    self.client.log_param(self.run_id, f"{section}.{key}", str(value)[:500])

    def log(self, metrics: dict[str, float], step: int) -> None:
        for key, value in metrics.items():
            self.client.log_metric(self.run_id, key, value, step=step)

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


def mlflow_client(uri: str):
    """An MlflowClient of the tracking store at `uri`; MLflow's refusal of the store (a file store while it is in
    maintenance mode, a scheme it has no store for) is one line naming MLFLOW_TRACKING_URI and what to set."""
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    try:
        return MlflowClient(tracking_uri=uri)
    except MlflowException as err:
        refusal = first_line(err).strip().split(". ")[0]
        source = " (MLFLOW_TRACKING_URI)" if os.environ.get("MLFLOW_TRACKING_URI") == uri else ""
        raise UsageError(f"--report-to mlflow: MLflow refuses the tracking store {uri}{source}: "
                         f"{refusal}; point MLFLOW_TRACKING_URI at a database (sqlite:///mlflow.db) or a tracking "
                         f"server (http://HOST:5000), or set MLFLOW_ALLOW_FILE_STORE=true to keep a file store, then "
                         f"run the same command again") from None


KINDS: dict[str, type] = {"tensorboard": TensorBoard, "wandb": WandB, "mlflow": MLflow}


class Trackers:
    """The run's trackers (none on a rank other than 0): `record` sends one record to each."""

    def __init__(self, trackers: list[Tracker]):
        self.trackers = trackers
        self.step = 0  # the run's last step: where a record other than a step's is logged

    @classmethod
    def open(cls, config: Config, out: Path, rank: int) -> Trackers:
        """The trackers `run.report_to` names, reporting into the run directory `out`; none unless `rank` is 0."""
        if rank != 0:
            return cls([])
        return cls([_opened(name, out, config) for name in tracker_names(config.run.report_to)])

    def record(self, record: Record) -> None:
        if not self.trackers:
            return
        if isinstance(record, StepRecord):
            self.step = record.step
        metrics = numbers(record.to_dict())
        for tracker in self.trackers:
            tracker.log(metrics, self.step)

    def close(self) -> None:
        for tracker in self.trackers:
            tracker.close()
        self.trackers = []


def _opened(name: str, out: Path, config: Config) -> Tracker:
    """Tracker `name` reporting into `out`; a folder it cannot write is one line naming it."""
    try:
        return KINDS[name](out, config)
    except OSError as error:
        raise _unwritable(name, Path(error.filename or RunDir(out).tracker_dir(name)), first_line(error)) from None


def numbers(values: dict[str, Any], prefix: str | None = None) -> dict[str, float]:
    """A record's numeric fields (nested ones such as a visit's memory peaks too) as {"<kind>/<field>": value}."""
    prefix = prefix if prefix is not None else str(values["kind"])
    found: dict[str, float] = {}
    for key, value in values.items():
        if isinstance(value, dict):
            found.update(numbers(value, f"{prefix}/{key}"))
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            found[f"{prefix}/{key}"] = float(value)
    return found
