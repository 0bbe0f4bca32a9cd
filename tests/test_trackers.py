"""--report-to: the run's records in TensorBoard event files and an MLflow file store, read back; a tracker that is
not installed refused before anything is written; rank 0 alone reports."""

import importlib.util
import json

import pytest

from preinfer.config import load_config
from preinfer.metrics import StepRecord
from pipelines.training.trackers import Trackers
from tests.helpers.cli_run import run_cli

TINY = ["--model", "tiny-llama", "--seq-len", "32", "--batch-size", "4", "--steps-per-visit", "2",
        "--eval-tokens", "128", "--lr", "1e-3", "--blocks", "2", "--max-samples", "16"]


def records_of(out, kind):
    return [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if r["kind"] == kind]


@pytest.mark.slow
def test_tensorboard_event_files_hold_the_step_and_visit_records(tmp_path, capsys):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "run"
    code, stdout, err = run_cli(["bcd", *TINY, "--out", str(out), "--report-to", "tensorboard"], capsys)
    assert code == 0, err
    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    steps = records_of(out, "step")
    loss = [(e.step, e.value) for e in events.Scalars("step/loss")]
    assert loss == [(r["step"], pytest.approx(r["loss"], rel=1e-6)) for r in steps]
    assert [e.value for e in events.Scalars("step/lr")] == pytest.approx([r["lr"] for r in steps], rel=1e-6)
    visits = records_of(out, "visit")
    eval_loss = [(e.step, e.value) for e in events.Scalars("visit/eval_loss")]
    assert eval_loss == [(2, pytest.approx(visits[0]["eval_loss"], rel=1e-6)),
                         (4, pytest.approx(visits[1]["eval_loss"], rel=1e-6))]  # at the visit's last step
    peak = events.Scalars("visit/memory/tracked_peak")
    assert [e.value for e in peak] == pytest.approx([v["memory"]["tracked_peak"] for v in visits], rel=1e-6)


@pytest.mark.slow
def test_an_mlflow_file_store_in_the_run_directory_holds_the_records(tmp_path, capsys, monkeypatch):
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)  # the run sets it for itself
    out = tmp_path / "run"
    code, _, err = run_cli(["bcd", *TINY, "--out", str(out), "--report-to", "mlflow"], capsys)
    assert code == 0, err
    client = MlflowClient(tracking_uri=(out / "mlruns").resolve().as_uri())
    experiment = client.get_experiment_by_name("preinfer")
    (run,) = client.search_runs([experiment.experiment_id])
    history = client.get_metric_history(run.info.run_id, "step/loss")
    assert sorted((m.step, m.value) for m in history) == [
        (r["step"], pytest.approx(r["loss"], rel=1e-6)) for r in records_of(out, "step")]
    assert run.data.params["optim.lr"] == "0.001" and run.info.status == "FINISHED"


def test_a_tracker_that_is_not_installed_is_refused_naming_its_extra_before_anything_is_written(
        tmp_path, capsys, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    out = tmp_path / "run"
    code, _, err = run_cli(["bcd", *TINY, "--out", str(out), "--report-to", "tensorboard,wandb"], capsys)
    assert code == 2
    assert err.strip().splitlines()[-1].endswith(
        "--report-to wandb: the wandb package is not installed; install it with pip install 'preinfer[wandb]'")
    assert not out.exists()


def test_an_unknown_tracker_is_refused_when_the_config_is_loaded():
    with pytest.raises(Exception, match=r"--report-to tensorboard,comet \(\[run\] report_to\): expected a comma "
                                        r"list of none, tensorboard, wandb, mlflow"):
        load_config(overrides={"run": {"report_to": "tensorboard,comet"}})


def test_only_rank_0_reports(tmp_path):
    pytest.importorskip("tensorboard")
    config = load_config(overrides={"run": {"report_to": "tensorboard"}})
    record = StepRecord(sweep=0, block=0, step=1, visit_step=1, loss=2.0, lr=1e-3, tokens=8, tokens_per_s=1.0,
                        wait_s=0.0)
    other = Trackers.open(config, tmp_path / "rank1", rank=1)
    other.record(record)
    other.close()
    assert other.trackers == [] and not (tmp_path / "rank1").exists()
    first = Trackers.open(config, tmp_path / "rank0", rank=0)
    first.record(record)
    first.close()
    assert list((tmp_path / "rank0" / "tensorboard").glob("events.out.tfevents.*"))
