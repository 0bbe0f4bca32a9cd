"""Crash states (issue 28, cases 9 and 10; DESIGN invariant 13): a job killed at each phase boundary of a checkpoint
save, a store's publish and a token store's publish (the kill injected in that phase's function, as SIGKILL would
leave it: `inject.py`), then run again or resumed, ends bit for bit where an uninterrupted job ends; a full disk
(a writer that raises ENOSPC) says which path and how to go on, and that way works."""

import json
from pathlib import Path

import pytest
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from preinfer.checkpoint import is_complete
from preinfer.run_dir import RunDir
from tests.helpers.cli_run import run_cli
from tests.helpers.disk_faults import ENOSPC, files, full_disk, stopped, works_once_freed
from tests.helpers.inject import forked

KILLED = 137


def killed_at(spec: str, argv: list[str], log: Path) -> None:
    """Run `preinfer ARGV` in a child process (forked: see inject.py's `forked`) killed at the phase `spec` names;
    assert it died there (its output in `log`)."""
    code = forked([f"{spec}=exit"], argv, log)
    assert code == KILLED, (code, log.read_text()[-2000:])


def reference_run(tmp_path_factory, argv: list[str]) -> Path:
    """Run `preinfer ARGV` uninterrupted, its `--out` (last) moved into a fresh directory; returns that path."""
    from pipelines.cli import main

    out = tmp_path_factory.mktemp("reference") / argv[-1]
    assert main([*argv[:-1], str(out)]) == 0
    return out


# ---- checkpoints ----


def bcd_args(corpus: str, out: Path) -> list[str]:
    return ["bcd", "--model", "tiny-llama", "--data", corpus, "--seq-len", "32", "--batch-size", "4",
            "--steps-per-visit", "3", "--blocks", "2", "--eval-tokens", "128", "--max-samples", "16", "--lr", "1e-3",
            "--pre-inference", "off", "--checkpoint-every", "1", "--out", str(out)]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, corpus) -> dict[str, torch.Tensor]:
    out = reference_run(tmp_path_factory, bcd_args(corpus, Path("run")))
    return load_file(str(out / "checkpoint" / "model.safetensors"))


# (kill point, the checkpoint entries it leaves): the third save, before its digest, after it, between its two
# renames (the old checkpoint moved aside, the new one not in place: issue 28's case 9), after both
CHECKPOINT_PHASES = {
    "preinfer.checkpoint:_write_digest@before#3": {"checkpoint", "checkpoint.tmp"},
    "preinfer.checkpoint:_write_digest@after#3": {"checkpoint", "checkpoint.tmp"},
    "preinfer.checkpoint:_retire@after#2": {"checkpoint.old", "checkpoint.tmp"},
    "preinfer.checkpoint:_publish@after#3": {"checkpoint", "checkpoint.old"},
}


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("phase", list(CHECKPOINT_PHASES))
def test_a_save_killed_at_any_phase_resumes_to_the_uninterrupted_weights(phase, tmp_path, corpus, uninterrupted,
                                                                        capsys):
    out = tmp_path / "run"
    killed_at(phase, bcd_args(corpus, out), tmp_path / "killed.log")
    assert {p.name for p in out.iterdir() if p.name.startswith("checkpoint")} == CHECKPOINT_PHASES[phase]
    code, _, err = run_cli([*bcd_args(corpus, out), "--resume"], capsys)
    assert code == 0, err
    got = load_file(str(out / "checkpoint" / "model.safetensors"))
    assert set(got) == set(uninterrupted) and all(torch.equal(got[k], uninterrupted[k]) for k in got)
    assert not (out / "checkpoint.tmp").exists() and not (out / "checkpoint.old").exists()
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["kind"] == "step"] == list(range(1, 7))  # a step logged before the
    assert [r["kind"] for r in records].count("visit") == 2  # kill is kept once, not twice


def test_a_full_disk_at_the_start_names_the_path_and_a_rerun_works(tmp_path, corpus, capsys, monkeypatch):
    """ENOSPC while config.toml is written (the run directory's first atomic write raises it, whether or not the
    token store the run reads was written before, by an earlier test): one line naming the file and saying to run
    the same command again, nothing left behind; the same command then runs."""
    out = tmp_path / "run"
    args = [*bcd_args(corpus, out), "--checkpoint-every", "0"]
    full_disk(monkeypatch, "preinfer.run_dir", "write_atomically", 1)
    code, _, err = run_cli(args, capsys)
    assert code == 1 and "Traceback" not in err, err
    line = err.strip().splitlines()[-1]
    assert str(out / "config.toml") in line and "No space left on device" in line and "same command again" in line
    assert not out.exists()  # no partial config.toml, no run directory: nothing left behind
    monkeypatch.undo()
    code, _, err = run_cli(args, capsys)
    assert code == 0, err


def full_disk_at(call: int, write, error: Exception):
    """`write`, except that its `call`-th call (1: the first) leaves a partial file, as a full disk does, and raises
    `error`."""
    calls = {"n": 0}

    def writer(tensors, filename, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] == call:
            Path(filename).write_bytes(b"partial")
            raise error
        return write(tensors, filename, *args, **kwargs)

    return writer


def assert_weights(out: Path, expected: dict[str, torch.Tensor]) -> None:
    got = load_file(str(out / "checkpoint" / "model.safetensors"))
    assert set(got) == set(expected) and all(torch.equal(got[k], expected[k]) for k in got)


@pytest.mark.slow
@pytest.mark.parametrize("call, error, how", [
    (6, ENOSPC, "resume"),  # the third save's second file: the second save's checkpoint is kept
    (6, SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)"), "resume"),
    (1, ENOSPC, "again"),  # the first save's first file: no checkpoint yet, the run starts over
], ids=["third-save", "third-save-safetensors", "first-save"])
def test_a_full_disk_while_a_checkpoint_is_written_names_it_and_the_named_way_on_works(call, error, how, tmp_path,
                                                                                      corpus, uninterrupted,
                                                                                      capsys, monkeypatch):
    """ENOSPC from the checkpoint's writer: one line naming the checkpoint being written, the last complete one kept
    (or none yet), and what to run after freeing space; that command ends with the uninterrupted run's weights."""
    import preinfer.checkpoint

    out = tmp_path / "run"
    monkeypatch.setattr(preinfer.checkpoint, "save_file", full_disk_at(call, preinfer.checkpoint.save_file, error))
    line = stopped(bcd_args(corpus, out), capsys)
    assert f"writing the checkpoint {out / 'checkpoint.tmp'} failed" in line
    assert "No space left on device" in line and "free space, then run" in line
    assert not (out / "checkpoint.tmp").exists()  # the partial checkpoint is gone, its space given back
    if how == "resume":
        assert f"kept in {out / 'checkpoint'}" in line and f"`preinfer bcd --out {out} --resume`" in line
        assert is_complete(out / "checkpoint")
        rerun = ["bcd", "--out", str(out), "--resume"]  # what the line says to run
    else:
        assert "no complete checkpoint was written yet" in line and "run the same command again" in line
        assert "--resume" not in line and not (out / "checkpoint").exists()
        rerun = bcd_args(corpus, out)
    works_once_freed(rerun, capsys, monkeypatch)
    assert_weights(out, uninterrupted)


# (a writer's module and name, the call that finds the disk full, what the line says to run): a metrics record before
# any checkpoint, one after the third, and the loss plot of a finished run
RUN_WRITERS = {
    "metrics-first": ("preinfer.metrics", "MetricsLog.write", 1, "again"),
    "metrics-later": ("preinfer.metrics", "MetricsLog.write", 8, "resume"),
    "finish": ("pipelines.training.run_directory", "plot_losses", 1, "resume"),
}


@pytest.mark.slow
@pytest.mark.parametrize("writer", list(RUN_WRITERS))
def test_a_full_disk_elsewhere_in_a_run_says_what_continues_it_and_that_works(writer, tmp_path, corpus,
                                                                               uninterrupted, capsys, monkeypatch):
    out = tmp_path / "run"
    *patched, how = RUN_WRITERS[writer]
    full_disk(monkeypatch, *patched)
    line = stopped(bcd_args(corpus, out), capsys, one_line=writer != "finish")
    assert f"the run in {out} stopped (No space left on device)" in line and "free space" in line
    if how == "resume":
        assert line.endswith(f"then run `preinfer bcd --out {out} --resume`")
        rerun = ["bcd", "--out", str(out), "--resume"]
    else:
        assert line.endswith("then run the same command again (no checkpoint was written: it starts the run over)")
        rerun = bcd_args(corpus, out)
    works_once_freed(rerun, capsys, monkeypatch)
    assert_weights(out, uninterrupted)
    assert (out / "summary.json").is_file() and (out / "loss.png").is_file() and (out / "export").is_dir()


@pytest.mark.slow
@pytest.mark.distributed
def test_an_export_killed_mid_write_keeps_the_previous_export_which_is_then_not_current(tmp_path, corpus,
                                                                                        uninterrupted, capsys):
    """A finished run resumed with a larger budget, killed once its new export has its config and weights but not
    its tokenizer: the previous export stays whole and bit for bit (no new config.json beside old weights), the run
    directory no longer counts it current (its checkpoint is newer: the checkpoint's weights are the model), and
    the same command writes the new export, leaving nothing of the killed one."""
    out = tmp_path / "run"
    code, _, err = run_cli([*bcd_args(corpus, out), "--total-steps", "3"], capsys)
    assert code == 0, err
    previous = files(out / "export")
    again = ["bcd", "--out", str(out), "--resume", "--total-steps", "6"]
    killed_at("pipelines.models.export:export_pretrained@after", again, tmp_path / "killed.log")
    assert files(out / "export") == previous and not RunDir(out).export_is_current()
    assert [p.name for p in out.iterdir() if p.name.startswith(".export.tmp-")] != []  # the killed export's
    code, _, err = run_cli(again, capsys)
    assert code == 0, err
    assert_weights(out, uninterrupted)
    exported = load_file(str(out / "export" / "model.safetensors"))
    assert set(exported) == set(uninterrupted) and all(torch.equal(exported[k], uninterrupted[k]) for k in exported)
    assert RunDir(out).export_is_current() and not [p for p in out.iterdir() if p.name.startswith(".export")]


# ---- stores ----


def cache_args(corpus: str, out: Path) -> list[str]:
    return ["cache", "--model", "tiny-llama", "--data", corpus, "--seq-len", "32", "--boundary", "2",
            "--samples-per-shard", "16", "--quiet", "--out", str(out)]


@pytest.fixture(scope="module")
def cached(tmp_path_factory, corpus) -> dict[str, bytes]:
    return files(reference_run(tmp_path_factory, cache_args(corpus, Path("cache"))))


STORE_PHASES = [
    "storage.store:Store.write_shard@after#2",  # a shard published, the rest not
    "storage.store:Store.finalize@before#1",  # every shard of a split published, the manifest not
    "storage.blobs:LocalBlobs.remove@before#1",  # the manifest published, the completion records not removed
    "storage.blobs:LocalBlobs.clear_locks@before#1",  # the records removed, the writers' lock files not
    "pipelines.cache.build:write_index@before",  # both stores final, the cache index not written
]


# ---- token stores ----


def tokenize_args(corpus: str, out: Path, *extra: str) -> list[str]:
    return ["tokenize", "--data", corpus, "--seq-len", "32", "--quiet", "--out", str(out), *extra]


@pytest.fixture(scope="module")
def tokenized(tmp_path_factory, corpus) -> dict[str, bytes]:
    return files(reference_run(tmp_path_factory, tokenize_args(corpus, Path("tokens"))))


TOKENIZE_PHASES = [
    "pipelines.data.token_store.staging:Staging.finish_encoding@after",  # staged, nothing packed
    "storage.store:Store.finalize@after#1",  # the train split published, eval not
    "pipelines.data.token_store.job:write_json@before",  # both splits published, not described
    "pipelines.data.token_store.job:write_json@after",  # described, the staging area not removed
]


PUBLISH_PHASES = [("cache", phase) for phase in STORE_PHASES] + [("tokenize", phase) for phase in TOKENIZE_PHASES]


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("job, phase", PUBLISH_PHASES)
def test_a_job_killed_at_any_publish_phase_resumes_to_the_same_bytes(job, phase, tmp_path, corpus, request, capsys):
    """The caching job (store publish) and tokenize (token store publish), killed, then the same command again."""
    argv = {"cache": cache_args, "tokenize": tokenize_args}[job]
    uninterrupted = request.getfixturevalue({"cache": "cached", "tokenize": "tokenized"}[job])
    out = tmp_path / "out"
    killed_at(phase, argv(corpus, out), tmp_path / "killed.log")
    code, _, err = run_cli(argv(corpus, out), capsys)
    assert code == 0, err
    assert files(out) == uninterrupted


@pytest.mark.parametrize("extra", [[], ["--overwrite"]], ids=["rerun", "overwrite"])
def test_a_staging_area_a_full_disk_left_is_resumed_or_overwritten(extra, tmp_path, corpus, tokenized, capsys):
    """Issue 28's case 10: a full disk while the plan was published left only its temporary file."""
    out = tmp_path / "tokens"
    (out / "staging").mkdir(parents=True)
    (out / "staging" / ".plan.json.tmp-4242").write_text('{"finger')
    code, _, err = run_cli(tokenize_args(corpus, out, *extra), capsys)
    assert code == 0, err
    assert files(out) == tokenized


# (a writer's module and name, the call of it that finds the disk full): tokenize's staging, its shard writes and its
# publish; the caching job's shard writes and its publish (with the path its line names, under --out)
TOKENIZE_WRITERS = {
    "staging-chunk": ("pipelines.data.token_store.staging", "np.savez", 1),
    "staging-record": ("pipelines.data.token_store.staging", "write_json", 2),
    "shard": ("storage.store", "Store.write_shard", 2),
    "publish-split": ("storage.store", "Store.finalize", 1),
    "publish-description": ("pipelines.data.token_store.job", "write_json", 1),
}
CACHE_WRITERS = {
    "shard": ("storage.store", "Store.write_shard", 2, "train"),
    "publish-split": ("storage.store", "Store.finalize", 2, "eval"),
    "publish-index": ("pipelines.cache.build", "write_index", 1, ""),
}


@pytest.mark.slow
@pytest.mark.parametrize("writer", list(TOKENIZE_WRITERS))
def test_a_full_disk_in_tokenize_names_out_and_the_same_command_resumes_it(writer, tmp_path, corpus, tokenized,
                                                                           capsys, monkeypatch):
    out = tmp_path / "tokens"
    full_disk(monkeypatch, *TOKENIZE_WRITERS[writer])
    line = stopped(tokenize_args(corpus, out), capsys)
    assert f"writing the token store in {out} failed (No space left on device" in line  # (at the file, if known)
    assert "free space, then run the same command again" in line
    works_once_freed(tokenize_args(corpus, out), capsys, monkeypatch)
    assert files(out) == tokenized


@pytest.mark.slow
@pytest.mark.parametrize("writer", list(CACHE_WRITERS))
def test_a_full_disk_in_the_caching_job_names_the_path_and_the_same_command_resumes_it(writer, tmp_path, corpus,
                                                                                       cached, capsys, monkeypatch):
    out = tmp_path / "cache"
    *patched, where = CACHE_WRITERS[writer]
    full_disk(monkeypatch, *patched)
    line = stopped(cache_args(corpus, out), capsys)
    assert f"disk full while writing the cache in {out / where if where else out}: " in line
    assert "No space left on device" in line and "Free space, then" in line and "rerun the same command" in line
    works_once_freed(cache_args(corpus, out), capsys, monkeypatch)
    assert files(out) == cached
