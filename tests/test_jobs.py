"""The job wiring every command shares (`pipelines.jobs`): an OSError ends a command in one line, an output that is
a file is refused before its lock is taken, a run records its paths absolute, and `Progress` prints whole lines
unless quiet."""

import errno
import os

import pytest

import pipelines.commands.plan as plan_command
from pipelines.cli import main
from pipelines.training.inputs import absolute_path, recorded_config
from pipelines.jobs.output import held_output
from pipelines.progress import Progress
from preinfer.config import Config
from preinfer.errors import UsageError
from storage.owner import LOCK_FILE


@pytest.mark.parametrize("error, first", [
    (OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "/data/x"), "free space"),
    (OSError(errno.EIO, os.strerror(errno.EIO)), "fix that"),
])
def test_an_os_error_no_job_maps_ends_the_command_in_one_line_with_exit_1(monkeypatch, capsys, error, first):
    def fail(args):
        raise error

    monkeypatch.setattr(plan_command, "run", fail)
    assert main(["plan", "--model", "7b"]) == 1
    where = f" at {error.filename}" if error.filename else ""
    assert capsys.readouterr().err == (f"preinfer plan: error: the job stopped ({error.strerror}{where}); {first}, "
                                       f"then run the same command again\n")


def test_an_output_that_is_a_file_is_refused_before_its_lock_is_taken(tmp_path):
    out = tmp_path / "out"
    out.write_text("mine")
    with pytest.raises(UsageError, match=f"--store-dir {out} is a file, not a directory"):
        with held_output(out, "--store-dir"):
            pass
    assert out.read_text() == "mine" and [p.name for p in tmp_path.iterdir()] == ["out"]


def test_an_output_is_held_while_the_job_runs_and_released_after(tmp_path):
    out = tmp_path / "new" / "out"
    with held_output(out) as where:
        assert (where / LOCK_FILE).read_text().startswith(f"pid {os.getpid()} on host ")
        (where / "result").write_text("written")
    assert not (out / LOCK_FILE).exists() and (out / "result").read_text() == "written"


def test_paths_are_recorded_absolute_and_names_that_are_no_paths_as_given(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert absolute_path("data.path", "corpus/a.txt") == str(tmp_path / "corpus" / "a.txt")
    assert absolute_path("data.path", "./*.jsonl") == str(tmp_path / "*.jsonl")
    for key, value in [("model.name", "tiny-llama"), ("model.tokenizer", "auto"), ("model.tokenizer", "byte"),
                       ("data.path", "builtin:pydoc"), ("store.path", "s3://bucket/cache"), ("data.token_store", None)]:
        assert absolute_path(key, value) == value
    config = Config()
    config.model.chat_template, config.pre_inference.store_dir = "t.jinja", "stores"
    recorded = recorded_config(config)
    assert (recorded.model.chat_template, recorded.pre_inference.store_dir) == (
        str(tmp_path / "t.jinja"), str(tmp_path / "stores"))
    assert (config.model.chat_template, config.run.out) == ("t.jinja", recorded.run.out)  # the run's own as given


def test_progress_prints_whole_lines_and_nothing_when_quiet(capsys):
    Progress().note("store at boundary 1: made")
    Progress(quiet=True).note("never shown")
    quiet = Progress(quiet=True)
    quiet.start("cache", "sample", 4)
    quiet.advance(4, tokens=128, nbytes=2**20)
    quiet.close()
    captured = capsys.readouterr()
    assert captured.out == "store at boundary 1: made\n" and captured.err == ""
    assert (quiet.tokens, quiet.bytes) == (128, 2**20)


def test_progress_counts_from_several_threads_without_losing_any():
    from concurrent.futures import ThreadPoolExecutor

    progress = Progress(quiet=True)
    progress.start("cache", "sample")
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda _: progress.advance(1, tokens=3, nbytes=5), range(400)))
    assert (progress.tokens, progress.bytes) == (1200, 2000)
