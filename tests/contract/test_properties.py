"""A contract suite that finds the next case by itself (issue 36, item 6): property-based tests that generate hostile
records, chat templates, config values and file-system states, and hold every generated case to the contract: it
succeeds, or it is refused in one line (exit 2 for bad input; 1 for an output the lock cannot take) without a
traceback; no file outside its output changes; memory stays bounded. Derandomized, so CI sees the same cases."""

import json
import os
import shutil
import stat
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.helpers.chat_templates import CHATML, save_tokenizer
from tests.helpers.cli_run import run_cli
from tests.helpers.peak_memory import RSS_GROWTH, peak_rss
from pipelines.data.chat import render_conversations
from pipelines.data.corpus import read_documents
from pipelines.data.in_memory import load_data
from pipelines.data.tokenizers import load_tokenizer, read_chat_template
from preinfer.errors import UsageError

FAST = settings(derandomize=True, max_examples=60, deadline=None, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
def one_line(message: str) -> str:
    assert message.strip() and "\n" not in message.strip() and "Traceback" not in message, message
    return message


def cli_line(err: str) -> str:
    """The one line a refused command printed (progress redraws before a carriage return left out)."""
    lines = [line.rsplit("\r", 1)[-1] for line in err.split("\n")]
    lines = [line for line in lines if line.strip()]
    assert "Traceback" not in err and len(lines) == 1, err
    return lines[0]


def outside(root: Path, output: Path) -> dict[str, tuple[str, bytes]]:
    """Every entry under `root` but not under `output`, with its kind and (for a plain file) its bytes; links and
    fifos are not followed or read."""
    found = {}
    for path in sorted(root.rglob("*")):
        if path == output or output in path.parents:
            continue
        mode = path.lstat().st_mode
        content = path.read_bytes() if stat.S_ISREG(mode) else os.readlink(path).encode() if stat.S_ISLNK(mode) else b""
        found[path.relative_to(root).as_posix()] = (stat.filemode(mode)[0], content)
    return found


# ---- hostile records ----

ODD_TEXT = st.text(st.characters(codec="utf-8", exclude_categories=["Cs"]), max_size=40) | st.sampled_from(
    ["\u2028", "\u0085", "\ufeff", "\r", "\x00", "é" * 3, "\U0001f600", "a\nb"])
VALUE = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | ODD_TEXT,
                     lambda inner: st.lists(inner, max_size=3) | st.dictionaries(ODD_TEXT, inner, max_size=3),
                     max_leaves=6)
TURN = st.fixed_dictionaries({}, optional={"role": st.sampled_from(["system", "user", "assistant", "robot"]) | VALUE,
                                           "content": ODD_TEXT | VALUE})
RECORD = st.one_of(
    st.fixed_dictionaries({"text": ODD_TEXT}),
    st.fixed_dictionaries({}, optional={"text": VALUE, "instruction": ODD_TEXT | VALUE, "input": VALUE,
                                        "output": ODD_TEXT | VALUE}),
    st.fixed_dictionaries({"messages": st.lists(TURN, max_size=4) | VALUE}),
    st.fixed_dictionaries({"text": st.just("x" * 200_000)}),  # a huge field
    VALUE,
)
LINE = st.one_of(RECORD.map(lambda record: json.dumps(record, ensure_ascii=False)), ODD_TEXT,
                 st.just("1" * 5000), st.just("[" * 5000))


@FAST
@given(lines=st.lists(LINE, min_size=1, max_size=6), bom=st.booleans())
def test_generated_jsonl_is_read_or_refused_in_one_line(tmp_path_factory, lines, bom):
    path = tmp_path_factory.mktemp("records") / "data.jsonl"
    path.write_bytes(("\ufeff" if bom else "").encode() + "\n".join(lines).encode("utf-8", errors="surrogatepass"))
    before = peak_rss()
    try:
        documents = read_documents(str(path))
        load_data(str(path), load_tokenizer("byte"), 32)
    except UsageError as error:
        assert str(error).startswith(str(path)) or "no documents" in str(error) or "needs a chat template" in str(
            error), error
        one_line(str(error))
    else:
        assert documents
    assert peak_rss() - before < RSS_GROWTH


# ---- hostile chat templates ----

SNIPPETS = st.sampled_from([
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}",
    "{% for m in messages %}{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}{% endgeneration %}"
    "{% else %}{{ m['content'] }}{% endif %}{% endfor %}",
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}",
    "{{ raise_exception('hostile') }}", "{{ 1 / 0 }}", "{{ 1 // 0 }}", "{{ messages + 1 }}", "{{ messages.nope.x }}",
    "{{ messages[99]['content'] }}", "{% for i in range(100001) %}{% endfor %}", "{% for i in range(1000) %}"
    "{{ i }}{% endfor %}", "{% include 'x.jinja' %}", "{% import 'x.jinja' as x %}", "{% extends 'x.jinja' %}",
    "{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}", "{% if %}", "{{ ", "{% endfor %}", "{% generation %}",
    "{{ ''.__class__.__mro__ }}", "{{ cycler.__init__.__globals__ }}", "{% set x = namespace(a=1) %}{{ x.a }}",
    "{{ messages | tojson }}", "plain text", "",
])


@pytest.fixture(scope="module")
def chatml_tokenizer(tmp_path_factory):
    return load_tokenizer(str(save_tokenizer(tmp_path_factory.mktemp("tok") / "chatml", CHATML)))


@FAST
@given(parts=st.lists(SNIPPETS, min_size=1, max_size=4), first=st.sampled_from(["user", "system", "assistant"]))
def test_generated_templates_render_or_are_refused_in_one_line(chatml_tokenizer, tmp_path_factory, parts, first):
    from pipelines.data.conversations import Conversation

    file = tmp_path_factory.mktemp("template") / "t.jinja"
    file.write_text("".join(parts))
    conversation = Conversation(((first, "hello"), ("user", "more"), ("assistant", "yes")), "chat.jsonl:7")
    before = peak_rss()
    original = chatml_tokenizer.chat_template
    try:
        chatml_tokenizer.chat_template = read_chat_template(str(file))
        render_conversations(chatml_tokenizer, [conversation])
    except UsageError as error:
        one_line(str(error))
        assert "chat.jsonl:7" in str(error) or str(file) in str(error), error
    finally:
        chatml_tokenizer.chat_template = original
    assert peak_rss() - before < RSS_GROWTH


# ---- config values ----

NUMERIC_FLAGS = ["--seq-len", "--batch-size", "--eval-fraction", "--eval-tokens", "--max-samples", "--lr",
                 "--momentum", "--weight-decay", "--grad-clip", "--steps-per-visit", "--blocks", "--sweeps",
                 "--min-delta", "--checkpoint-every", "--samples-per-shard"]
NUMBER = st.one_of(st.integers(-10**12, 10**12).map(str), st.floats().map(str),
                   st.sampled_from(["0", "-0", "1e400", "nan", "-inf", "0x10", "1_000", "", " 1", "1/3", "१"]))


@pytest.mark.slow
@settings(derandomize=True, max_examples=40, deadline=None, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(values=st.dictionaries(st.sampled_from(NUMERIC_FLAGS), NUMBER, min_size=1, max_size=3))
def test_generated_config_values_are_refused_in_one_line_before_anything_is_written(tmp_path_factory, capsys,
                                                                                   values):
    root = tmp_path_factory.mktemp("config")
    out = root / "run"
    flags = [item for flag, value in values.items() for item in (f"{flag}={value}",)]
    code, _, err = run_cli(["bcd", "--model", "tiny-llama", "--data", str(root / "missing.txt"), *flags, "--out",
                            str(out)], capsys)
    assert code == 2, err
    cli_line(err)
    assert not out.exists()


def toml_value(value) -> str:
    """`value` written as a TOML value."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, float):
        return {"nan": "nan", "inf": "inf", "-inf": "-inf"}.get(str(value), repr(value))
    return json.dumps(value)


def config_keys() -> list[tuple[str, str]]:
    from pipelines.flags import TRAINING_FLAGS

    return sorted({(flag.section, flag.key) for flag in TRAINING_FLAGS if flag.section and flag.section != "run"})


TOML_VALUE = st.one_of(st.integers(-10**6, 10**6), st.floats(), st.booleans(), ODD_TEXT,
                       st.lists(st.integers(-3, 3) | st.floats(-2, 2), max_size=3))


@pytest.mark.slow
@settings(derandomize=True, max_examples=40, deadline=None, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(values=st.dictionaries(st.sampled_from(config_keys()), TOML_VALUE, min_size=1, max_size=3))
def test_generated_config_files_are_refused_in_one_line_before_anything_is_written(tmp_path_factory, capsys,
                                                                                  values):
    root = tmp_path_factory.mktemp("toml")
    sections: dict[str, list[str]] = {}
    for (section, key), value in values.items():
        sections.setdefault(section, []).append(f"{key} = {toml_value(value)}")
    (root / "run.toml").write_text("".join(f"[{name}]\n" + "\n".join(lines) + "\n" for name, lines in sections.items()))
    out = root / "run"
    code, _, err = run_cli(["bcd", "--model", "tiny-llama", "--data", str(root / "missing.txt"), "--config",
                            str(root / "run.toml"), "--out", str(out)], capsys)
    assert code == 2, err
    cli_line(err)
    assert not out.exists()


# ---- file-system states ----

PLACES = [".owner.lock", "config.toml", "metrics.jsonl", "checkpoint/state.json", "checkpoint/model.safetensors",
          "checkpoint/digest.json", "checkpoint", "tensorboard", "export/config.json"]


def put(path: Path, kind: str, target: Path) -> None:
    """Put a `kind` (symlink to `target`, directory, fifo, read-only file) where `path` was."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()
    path.parent.mkdir(parents=True, exist_ok=True)
    if kind == "symlink":
        path.symlink_to(target)
    elif kind == "directory":
        path.mkdir()
    elif kind == "fifo":
        os.mkfifo(path)
    else:
        path.write_text("read-only")
        path.chmod(0o444)


@pytest.mark.slow
@settings(derandomize=True, max_examples=36, deadline=None, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(place=st.sampled_from(PLACES), kind=st.sampled_from(["symlink", "directory", "fifo", "read-only"]))
def test_generated_file_system_states_resume_or_are_refused_in_one_line_and_nothing_outside_changes(
        finished, tmp_path_factory, capsys, place, kind):
    root = tmp_path_factory.mktemp("fs")
    out = root / "run"
    shutil.copytree(finished[0], out)
    (root / "users.txt").write_text("the user's")
    (root / "users").mkdir()
    put(out / place, kind, root / ("users" if place in ("checkpoint", "tensorboard") else "users.txt"))
    before = outside(root, out)
    code, _, err = run_cli([*finished[1][:-1], str(out), "--resume"], capsys)
    assert code in (0, 1, 2), err
    if code:
        cli_line(err)
    assert outside(root, out) == before
