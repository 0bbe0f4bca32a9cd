"""The run directory: its layout (`RunDir`), its typed metrics records, the one `--model` resolver, and bad
input that leaves nothing behind."""

import json

import pytest

from pipelines.models import model_source
from preinfer.errors import PreinferError
from preinfer.metrics import (RECORD_KINDS, CacheRecord, ImportanceRecord, PlanOutcomeRecord, PreInferenceRecord,
                              ResolvedRecord, StepRecord, SweepPlanRecord, VisitRecord, parse_record, read_metrics)
from preinfer.run_dir import RunDir
from tests.helpers.cli_run import run_cli

TINY = ["--model", "tiny-llama", "--seq-len", "32", "--batch-size", "4", "--steps-per-visit", "2",
        "--eval-tokens", "128", "--lr", "1e-3", "--max-samples", "16"]

EXAMPLES = [
    StepRecord(sweep=0, block=1, step=7, visit_step=2, loss=2.5, lr=1e-3, tokens=640, tokens_per_s=900.0,
               wait_s=0.01),
    VisitRecord(sweep=1, block=0, label="embed+layers 0-1", steps=4, stop_reason="plateau", eval_loss=3.25,
                wall_s=1.5, tokens=2048, source_boundary=0, memory={"params": 10, "activations": 4}),
    CacheRecord(boundary=2, how="roll_forward", seconds=0.5, bytes=4096, from_=1),
    CacheRecord(boundary=2, how="deleted", seconds=0.0, bytes=0, reason="block 0 changed layers below it"),
    CacheRecord(boundary=3, how="reuse", seconds=0.0, bytes=0),
    PreInferenceRecord(block=1, boundary=2, decision="store", steps=10, prefix_per_step=0.1, read_per_step=0.01,
                       eval_prefix=0.2, build=0.3, build_from=0, store_bytes=1 << 20, free_bytes=1 << 30,
                       saving_s=0.8),
    ImportanceRecord(sweep=1, scores=[0.25, 0.5, 0.125], order=[1, 0], chosen="importance", spread=0.5, due=[],
                     batches=2, seconds=0.1),
    VisitRecord(sweep=1, block=1, label="layers 2-3", steps=9, stop_reason="gain", eval_loss=3.0, wall_s=1.0,
                tokens=4096, source_boundary=2, gain={"window": 2, "rate": 0.1, "initial_rate": 0.4,
                                                      "horizon_s": 8.0, "ratios": {"0": 0.5},
                                                      "switch_s": {"0": 0.0}, "predicted": {"0": 0.2},
                                                      "best": "0"}),
]


def test_run_dir_names_every_part_of_the_layout(tmp_path):
    run = RunDir(tmp_path / "run")
    parts = {run.config: "config.toml", run.metrics: "metrics.jsonl", run.checkpoint: "checkpoint",
             run.export: "export", run.loss_plot: "loss.png", run.summary: "summary.json", run.stores: "stores"}
    assert all(path.parent == run.path and path.name == name for path, name in parts.items())
    assert run.checkpoint_weights.parent == run.checkpoint
    assert not run.holds_run() and not run.is_resumable() and not run.export_is_current()


@pytest.mark.parametrize("record", EXAMPLES, ids=lambda r: f"{r.kind}")
def test_every_record_kind_round_trips_through_json(record):
    data = json.loads(json.dumps(record.to_dict()))
    assert next(iter(data)) == "kind" and data["kind"] == record.kind
    assert parse_record(data) == record


def test_json_keys_of_records():
    step, visit, made, deleted, reused, decision, _, gain_visit = (e.to_dict() for e in EXAMPLES)
    assert made["from"] == 1 and "from_" not in made and "reason" not in made
    assert deleted["reason"].startswith("block 0") and "from" not in deleted
    assert set(reused) == {"kind", "boundary", "how", "seconds", "bytes"}
    assert set(RECORD_KINDS) == {"step", "visit", "cache", "pre_inference", "budget_plan", "sweep_plan",
                                 "plan_outcome", "resume", "importance", "resolved"}
    assert "gain" not in visit and gain_visit["gain"]["predicted"] == {"0": 0.2}
    assert decision["saving_s"] == 0.8 and visit["memory"] == {"params": 10, "activations": 4}


def test_unknown_kinds_and_missing_fields_are_refused(tmp_path):
    with pytest.raises(PreinferError, match="unknown metrics record kind 'epoch'"):
        parse_record({"kind": "epoch"})
    with pytest.raises(PreinferError, match="'step'"):
        parse_record({"kind": "step", "sweep": 0})
    path = tmp_path / "metrics.jsonl"
    path.write_text(json.dumps(EXAMPLES[0].to_dict()) + "\n" + '{"kind": "nope"}\n')
    with pytest.raises(PreinferError, match="line 2"):
        read_metrics(path)


@pytest.mark.slow
def test_a_run_writes_typed_records_and_resolves_as_a_model(tmp_path, capsys):
    out = tmp_path / "run"
    code, _, err = run_cli(["bcd", *TINY, "--blocks", "2", "--seed", "5", "--pre-inference", "on",
                         "--out", str(out)], capsys)
    assert code == 0, err
    run = RunDir(out)
    records = read_metrics(run.metrics)
    assert {type(r) for r in records} == {StepRecord, VisitRecord, CacheRecord, PreInferenceRecord, SweepPlanRecord,
                                          PlanOutcomeRecord, ResolvedRecord}
    visits = [r for r in records if isinstance(r, VisitRecord)]
    assert [v.block for v in visits] == [0, 1] and visits[1].source_boundary > 0
    assert json.loads(run.summary.read_text())["visits"] == [v.to_dict() for v in visits]
    assert run.is_resumable() and run.export_is_current() and run.loss_plot.is_file()

    source, config = model_source(str(out))
    assert config is not None and config.run.seed == 5 and source.seed == 5
    assert model_source(str(out), seed=3)[0].seed == 3
    assert model_source("tiny-llama") == (model_source("tiny-llama", seed=0)[0], None)


@pytest.mark.parametrize("argv, message", [
    (["--ranges", "3-1"], "3-1"),
    (["--order", "fixed", "--fixed-order", "0,0"], "--fixed-order"),
    (["--order", "fixed"], "--fixed-order"),
    (["--start-block", "9"], "--start-block"),
    (["--active", "7-9"], "7-9"),
    (["--data", "/nonexistent/corpus.txt"], "/nonexistent/corpus.txt"),
    (["--model", "no-such-preset"], "no-such-preset"),
    (["--tokenizer", "/nonexistent/tokenizer"], "/nonexistent/tokenizer"),
    (["--pre-inference", "on", "--dask", "local:zero"], "--dask"),
])
def test_bad_input_leaves_no_run_directory(argv, message, tmp_path, capsys):
    out = tmp_path / "new" / "run"
    code, _, err = run_cli(["bcd", *TINY, *argv, "--out", str(out)], capsys)
    assert code == 2 and message in err, err
    assert not (tmp_path / "new").exists()


def test_a_bad_store_leaves_no_run_directory(tmp_path, capsys):
    out = tmp_path / "run"
    code, _, err = run_cli(["train", "--store", str(tmp_path / "no-cache"), "--model", "tiny-llama", "--out", str(out)],
                        capsys)
    assert code != 0 and "no-cache" in err, err
    assert not out.exists()
