"""A run knows what it was trained on (issue 36): its config.toml names the tokenizer, chat template and data by
absolute paths, inputs.json holds their fingerprints, and `--resume` trains on exactly those or refuses in one line
naming what changed (exit 2), from whatever working directory it is run."""

import shutil
import tomllib
from pathlib import Path

import pytest

from pipelines.data.tokenizers import ByteTokenizer
from tests.helpers.cli_run import failure_line, run_cli, tree

TEMPLATE = "{% for message in messages %}{{ message['content'] }}{{ eos_token }}{% endfor %}"


def inputs_in(directory: Path, corpus: str, template: str) -> Path:
    """A working directory holding a tokenizer `tok/`, a chat template `t.jinja` and a corpus `corpus.txt`."""
    directory.mkdir()
    ByteTokenizer().save(directory / "tok")
    (directory / "t.jinja").write_text(template)
    shutil.copy(corpus, directory / "corpus.txt")
    return directory


@pytest.fixture
def started(tiny, corpus, tmp_path, monkeypatch, capsys) -> tuple[Path, Path, list[str]]:
    """A finished tiny run started in `a/` with relative --tokenizer, --chat-template and --data; returns (its
    directory, a/, the command line that made it)."""
    a = inputs_in(tmp_path / "a", corpus, TEMPLATE)
    out = tmp_path / "run"
    argv = ["bcd", *tiny, "--tokenizer", "tok", "--chat-template", "t.jinja", "--data", "corpus.txt",
            "--out", str(out)]
    monkeypatch.chdir(a)
    code, _, err = run_cli(argv, capsys)
    assert code == 0, err
    return out, a, argv


@pytest.mark.slow
def test_the_run_records_absolute_paths_and_resumes_on_them_from_another_directory(started, corpus, tmp_path,
                                                                                   monkeypatch, capsys):
    """Resumed from `b/`, whose relative tok/, t.jinja and corpus.txt are other inputs, the run trains on a/'s."""
    out, a, _ = started
    model = tomllib.loads((out / "config.toml").read_text())["model"]
    data = tomllib.loads((out / "config.toml").read_text())["data"]
    assert (model["tokenizer"], model["chat_template"], data["path"]) == (
        str(a / "tok"), str(a / "t.jinja"), str(a / "corpus.txt"))
    b = inputs_in(tmp_path / "b", corpus, TEMPLATE.replace("eos_token", "bos_token"))
    (b / "corpus.txt").write_text("other data " * 500)
    monkeypatch.chdir(b)
    code, _, err = run_cli(["bcd", "--out", str(out), "--resume", "--sweeps", "2"], capsys)
    assert code == 0, err
    assert (out / "export" / "chat_template.jinja").read_text() == TEMPLATE  # a/'s template, not b/'s


@pytest.mark.slow
def test_a_relative_flag_on_resume_that_names_other_data_from_another_directory_is_refused(started, corpus, tmp_path,
                                                                                          monkeypatch, capsys):
    out, a, _ = started
    b = inputs_in(tmp_path / "b", corpus, TEMPLATE)
    monkeypatch.chdir(b)
    before = tree(out)
    code, _, err = run_cli(["bcd", "--out", str(out), "--resume", "--data", "corpus.txt"], capsys)
    line = failure_line(err)
    assert code == 2 and f"[data] path '{a / 'corpus.txt'}' -> '{b / 'corpus.txt'}'" in line, line
    assert tree(out) == before


@pytest.mark.slow
@pytest.mark.parametrize("change, named", [
    ("corpus.txt", "the data"), ("t.jinja", "the chat template"),
])
def test_an_input_changed_under_the_same_path_refuses_resume_naming_it(started, change, named, monkeypatch,
                                                                        capsys):
    out, a, argv = started
    path = a / change
    path.write_text(path.read_text() + "{# edited #}")
    before = tree(out)
    code, _, err = run_cli([*argv, "--resume"], capsys)
    line = failure_line(err)
    assert code == 2 and line.startswith(f"preinfer bcd: error: --resume: {named}") and "changed" in line, line
    assert str(path) in line
    assert tree(out) == before


@pytest.mark.slow
def test_the_same_run_resumes_with_its_relative_flags_when_nothing_changed(started, capsys):
    """Resumed with the very command that started it (relative flags, the same directory): the paths and the
    inputs are the run's own, and only the sweeps it asks for change."""
    out, _, argv = started
    code, stdout, err = run_cli([*argv, "--resume", "--sweeps", "2"], capsys)
    assert code == 0, err
    assert "resumed after step 4; changed blocks.sweeps 1 -> 2" in stdout


@pytest.mark.slow
def test_a_damaged_record_of_the_inputs_refuses_resume_in_one_line(started, capsys):
    out, _, argv = started
    (out / "inputs.json").write_text("[1, 2")
    code, _, err = run_cli([*argv, "--resume"], capsys)
    assert code == 2 and f"{out / 'inputs.json'} is not a readable JSON record" in failure_line(err)
