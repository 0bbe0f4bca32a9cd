"""The contract on inputs (issue 28): resume means the same run, and inputs that would give a silently wrong
result are refused in one line, leaving nothing behind."""

import hashlib
import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.helpers.cli_run import failure_line, run_cli, tree
from pipelines.models import load_model
from preinfer.presets import build_preset

def record_digest(checkpoint: Path) -> None:
    """Record the sha256 of the checkpoint's files as they are now (its digest.json)."""
    names = ("model.safetensors", "state.safetensors", "state.json")
    digests = {name: hashlib.sha256((checkpoint / name).read_bytes()).hexdigest() for name in names}
    (checkpoint / "digest.json").write_text(json.dumps(digests))


def copy_tree(source: Path, target: Path) -> Path:
    shutil.copytree(source, target)
    return target


@pytest.mark.slow
def test_resume_refuses_flags_that_change_the_run(finished, capsys):
    out, argv = finished
    before = tree(out)
    code, _, err = run_cli([*argv, "--resume", "--lr", "0.5", "--optimizer", "sgd"], capsys)
    line = failure_line(err)
    assert code == 2 and "[optim] lr 0.001 -> 0.5" in line and "[optim] name 'adam' -> 'sgd'" in line
    assert tree(out) == before


@pytest.mark.slow
def test_resume_with_the_same_flags_a_new_checkpoint_interval_and_more_sweeps_is_recorded(finished, tmp_path,
                                                                                           capsys):
    out = copy_tree(finished[0], tmp_path / "run")
    argv = [*finished[1][:-1], str(out)]
    code, _, err = run_cli([*argv, "--resume", "--checkpoint-every", "3", "--sweeps", "2"], capsys)
    assert code == 0, err
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    resumed = next(r for r in records if r["kind"] == "resume")
    assert resumed == {"kind": "resume", "step": 4,
                       "changed": {"blocks.sweeps": [1, 2], "run.checkpoint_every": [0, 3]}}
    assert [r["step"] for r in records if r["kind"] == "step"] == list(range(1, 9))  # the second sweep trained
    assert "checkpoint_every = 0" in (out / "config.toml").read_text()  # the run's own config stays


@pytest.mark.slow
def test_resume_drops_what_a_killed_run_logged_after_its_checkpoint(finished, tmp_path, capsys):
    """A SIGKILL after step 5's record but before its checkpoint, mid-write of the next line: the resumed run
    keeps each step once."""
    out = copy_tree(finished[0], tmp_path / "run")
    lines = (out / "metrics.jsonl").read_text().splitlines()
    step = json.loads(next(line for line in lines if '"kind": "step"' in line))
    (out / "metrics.jsonl").write_text("\n".join([*lines, json.dumps({**step, "step": 5}), '{"kind": "st']) + "\n")
    code, _, err = run_cli([*finished[1][:-1], str(out), "--resume"], capsys)
    assert code == 0, err
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in records if r["kind"] == "step"]
    assert steps == [1, 2, 3, 4]
    assert [r["kind"] for r in records].count("visit") == 2


@pytest.mark.slow
@pytest.mark.parametrize("field, value, named", [
    ("visit", 10**12, "trainer.visit = 1000000000000"),
    ("global_step", "x", "trainer.global_step = 'x'"),
    ("cursor", 7, "trainer.cursor = 7"),
    ("sweep", -1, "trainer.sweep = -1"),
])
def test_a_checkpoint_state_field_out_of_type_or_range_is_one_line(finished, tmp_path, capsys, field, value,
                                                                   named):
    out = copy_tree(finished[0], tmp_path / "run")
    state = json.loads((out / "checkpoint" / "state.json").read_text())
    state["trainer"][field] = value
    (out / "checkpoint" / "state.json").write_text(json.dumps(state))
    record_digest(out / "checkpoint")  # the values are wrong, not the file: what a faulty writer leaves
    before = tree(out)
    code, _, err = run_cli([*finished[1][:-1], str(out), "--resume"], capsys)
    assert code == 1 and named in failure_line(err)
    assert tree(out) == before


@pytest.mark.parametrize("flags, named", [
    (["--betas", "1.5,0.9"], "--betas 1.5,0.9"),
    (["--betas", "0.9,1"], "--betas 0.9,1.0"),
    (["--optimizer", "sgd", "--momentum", "-1"], "--momentum -1.0"),
    (["--weight-decay", "-1"], "--weight-decay -1.0"),
    (["--weight-decay", "inf"], "--weight-decay inf"),
    (["--grad-clip", "nan"], "--grad-clip nan"),
    (["--min-delta", "nan"], "--min-delta nan"),
])
def test_optimizer_values_out_of_range_are_refused_before_anything_is_written(tiny, tmp_path, capsys, flags,
                                                                              named):
    out = tmp_path / "run"
    code, _, err = run_cli(["bcd", *tiny, "--out", str(out), *flags], capsys)
    assert code == 2 and named in failure_line(err)
    assert not out.exists()


def test_optimizer_values_from_a_config_file_are_checked_too(tiny, tmp_path, capsys):
    config = tmp_path / "run.toml"
    config.write_text("[optim]\nbetas = [0.9, -0.1]\n")
    code, _, err = run_cli(["bcd", *tiny, "--config", str(config), "--out", str(tmp_path / "run")], capsys)
    assert code == 2 and "[optim] betas" in failure_line(err) and not (tmp_path / "run").exists()


def test_a_diverging_run_stops_naming_the_step_and_keeps_its_last_finite_checkpoint(tiny, corpus, tmp_path,
                                                                                   capsys):
    out = tmp_path / "run"
    code, _, err = run_cli(["bcd", *tiny, "--data", corpus, "--out", str(out), "--optimizer", "sgd", "--lr", "1e30",
                            "--steps-per-visit", "4", "--checkpoint-every", "1"], capsys)
    line = failure_line(err)
    assert code == 1 and "training diverged" in line and "step 2" in line
    assert not (out / "export").exists() and not (out / "summary.json").exists()
    weights = load_file(str(out / "checkpoint" / "model.safetensors"))
    assert all(bool(t.isfinite().all()) for t in weights.values())
    state = json.loads((out / "checkpoint" / "state.json").read_text())
    assert state["trainer"]["global_step"] == 1
    losses = [json.loads(x)["loss"] for x in (out / "metrics.jsonl").read_text().splitlines() if '"step"' in x]
    assert all(math.isfinite(loss) for loss in losses)


def test_a_run_whose_weights_overflow_exports_nothing(tiny, corpus, tmp_path, capsys):
    """Both steps' losses are finite, the second step's update is not: the end-of-visit checkpoint refuses the
    weights."""
    out = tmp_path / "run"
    code, _, err = run_cli(["bcd", *tiny, "--data", corpus, "--out", str(out), "--optimizer", "sgd", "--lr", "1e30"],
                           capsys)
    assert code == 1 and "is not finite after step 2" in failure_line(err)
    assert not (out / "checkpoint").exists() and not (out / "export").exists()


def test_a_batch_larger_than_the_split_is_refused(tiny, corpus, tmp_path, capsys):
    """Refused by the memory check before the model loads, naming the batch size; past the check, by the split."""
    out = tmp_path / "run"
    code, _, err = run_cli(["bcd", *tiny, "--data", corpus, "--out", str(out), "--batch-size", "1000000000"], capsys)
    assert code == 2 and "a smaller --batch-size" in failure_line(err) and not out.exists()
    code, _, err = run_cli(["bcd", *tiny, "--data", corpus, "--out", str(out), "--batch-size", "1000000000",
                            "--skip-memory-check"], capsys)
    assert code == 2 and "--batch-size 1000000000 is more than the" in failure_line(err)
    assert not out.exists()


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    """Saved models: tiny-llama whole and without layer 1, and tiny-gpt2 (its head tied to the embedding, saved
    once)."""
    root = tmp_path_factory.mktemp("models")
    build_preset("tiny-llama").save_pretrained(root / "llama")
    build_preset("tiny-gpt2").save_pretrained(root / "gpt2")
    copy_tree(root / "llama", root / "no-layer-1")
    tensors = load_file(str(root / "llama" / "model.safetensors"))
    kept = {name: tensor for name, tensor in tensors.items() if ".layers.1." not in name}
    save_file(kept, str(root / "no-layer-1" / "model.safetensors"), metadata={"format": "pt"})
    return root


def test_a_model_missing_a_layer_is_refused_naming_its_first_tensor(tiny, model_dirs, corpus, tmp_path, capsys):
    out = tmp_path / "run"
    code, _, err = run_cli(["bcd", *tiny, "--model", str(model_dirs / "no-layer-1"), "--data", corpus,
                            "--out", str(out)], capsys)
    line = failure_line(err)
    assert code == 2 and "lack model.layers.1.self_attn.q_proj.weight and 8 more" in line
    assert not out.exists()


def test_tied_weights_saved_once_count_as_present(model_dirs):
    assert "lm_head.weight" not in load_file(str(model_dirs / "gpt2" / "model.safetensors"))
    model = load_model(str(model_dirs / "gpt2"))
    assert model.lm_head.weight is model.transformer.wte.weight
    expected = build_preset("tiny-gpt2")
    assert torch.equal(model.transformer.wte.weight, expected.transformer.wte.weight)


def test_plan_refuses_an_architecture_it_cannot_stage(bert, capsys):
    for spec in (bert, bert / "config.json"):
        code, stdout, err = run_cli(["plan", "--model", str(spec)], capsys)
        assert code == 2 and "cannot stage a BertLMHeadModel" in failure_line(err) and stdout == ""


@pytest.mark.slow
def test_verify_fails_for_a_split_cache_json_lists_without_its_manifest(cache, tmp_path, capsys):
    damaged = copy_tree(cache, tmp_path / "c")
    (damaged / "eval" / "manifest.json").unlink()
    code, stdout, err = run_cli(["verify", str(damaged)], capsys)
    assert code == 1 and err == ""
    assert "eval: MISSING: cache.json lists this split" in stdout
    assert stdout.splitlines()[-1] == "verify: FAILED (eval)"


@pytest.mark.slow
def test_a_suffix_model_missing_a_tensor_it_trains_is_refused(cache, model_dirs, tmp_path, capsys):
    weights = load_file(str(model_dirs / "llama" / "model.safetensors"))
    model = copy_tree(model_dirs / "llama", tmp_path / "no-layer-3")
    save_file({k: v for k, v in weights.items() if ".layers.3." not in k}, str(model / "model.safetensors"),
              metadata={"format": "pt"})
    out = tmp_path / "run"
    code, _, err = run_cli(["train", "--model", str(model), "--store", str(cache), "--steps-per-visit", "1",
                            "--blocks", "1", "--out", str(out), "--trust-store"], capsys)
    assert code == 2 and "model.layers.3." in failure_line(err) and not out.exists()
