"""The contract, round two (issue 36, items 2-4): the examples that broke, kept as named regression tests. Inputs
are read as the user means them; a hostile chat template or record is one line naming it; the file system never
surprises a run (a symlink, directory or fifo where a run keeps a file is refused, and nothing outside the run
directory changes)."""

import json
import os
import shutil
from pathlib import Path

import datasets
import pytest
from transformers import AutoTokenizer

import storage
from tests.helpers.chat_templates import CHATML, save_tokenizer
from tests.helpers.cli_run import failure_line, run_cli, tree
from tests.helpers.owner_holder import HOST, hold
from tests.helpers.peak_memory import RSS_GROWTH, peak_rss
from pipelines.data.chat import render_conversations
from pipelines.data.conversations import Conversation
from pipelines.data.corpus import read_documents
from pipelines.data.in_memory import load_data
from pipelines.data.tokenizers import MAX_TEMPLATE_BYTES, load_tokenizer
from pipelines.store_training import load_store_suffix
from preinfer.errors import UsageError
from storage.owner import OwnerLockError

CHAT = [{"messages": [{"role": "user", "content": f"question {i}?"}, {"role": "assistant", "content": f"answer {i}"}]}
        for i in range(6)]


def write_jsonl(path: Path, records: list) -> str:
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return str(path)


@pytest.fixture(scope="module")
def chat_tokenizer(tmp_path_factory) -> Path:
    return save_tokenizer(tmp_path_factory.mktemp("tok") / "chatml", CHATML)


# ---- data loss: the owner lock ----


def lock_in_place(out: Path, kind: str, target: Path) -> None:
    out.mkdir(parents=True)
    lock = out / storage.owner.LOCK_FILE
    {"symlink": lambda: lock.symlink_to(target), "directory": lock.mkdir, "fifo": lambda: os.mkfifo(lock)}[kind]()


@pytest.mark.parametrize("kind", ["symlink", "directory", "fifo"])
def test_an_owner_lock_that_is_not_a_plain_file_is_one_line_and_nothing_is_written_through_it(tmp_path, kind):
    target = tmp_path / "users.txt"
    target.write_text("the user's")
    lock_in_place(tmp_path / "out", kind, target)
    with pytest.raises(OwnerLockError) as error, storage.owning(tmp_path / "out"):
        pytest.fail("the lock was taken")
    assert f"is a {kind.replace('symlink', 'symbolic link')}" in str(error.value) and "\n" not in str(error.value)
    assert target.read_text() == "the user's"


def test_tokenize_on_an_output_whose_lock_is_a_symlink_exits_1_and_keeps_the_target(tmp_path, corpus, capsys):
    target = tmp_path / "users.txt"
    target.write_text("the user's")
    lock_in_place(tmp_path / "out", "symlink", target)
    code, _, err = run_cli(["tokenize", "--data", corpus, "--quiet", "--out", str(tmp_path / "out")], capsys)
    assert code == 1 and "owner lock .owner.lock is a symbolic link" in failure_line(err)
    assert target.read_text() == "the user's"


# ---- the file system: run directories ----


def test_a_checkpoint_file_that_is_a_symlink_is_refused_on_resume_and_its_target_kept(finished, tmp_path, capsys):
    out = tmp_path / "run"
    shutil.copytree(finished[0], out)
    target = tmp_path / "users.json"
    shutil.move(out / "checkpoint" / "state.json", target)
    (out / "checkpoint" / "state.json").symlink_to(target)
    before = tree(tmp_path)
    code, _, err = run_cli([*finished[1][:-1], str(out), "--resume"], capsys)
    assert code == 2 and "'checkpoint/state.json' is a symbolic link" in failure_line(err)
    assert tree(tmp_path) == before


@pytest.mark.parametrize("name, make", [
    ("metrics.jsonl", lambda path: os.mkfifo(path)),
    ("tensorboard", lambda path: path.write_text("a file")),
    ("checkpoint", lambda path: path.symlink_to(path.parent.parent)),
])
def test_an_entry_of_the_wrong_type_in_a_run_directory_is_one_line(tiny, corpus, tmp_path, capsys, name, make):
    out = tmp_path / "run"
    out.mkdir()
    (out / "config.toml").write_text("")
    make(out / name)
    code, _, err = run_cli(["bcd", *tiny, "--data", corpus, "--out", str(out)], capsys)
    assert code == 2 and f"'{name}' is a" in failure_line(err)


def test_a_run_killed_before_its_first_checkpoint_with_tracker_folders_is_started_again(tiny, corpus, tmp_path,
                                                                                        capsys):
    out = tmp_path / "run"
    for folder in ("tensorboard", "mlruns", "wandb"):
        (out / folder).mkdir(parents=True)
    (out / "config.toml").write_text("")
    code, _, err = run_cli(["bcd", *tiny, "--data", corpus, "--out", str(out)], capsys)
    assert code == 0, err


def test_a_read_only_tracker_folder_is_one_line(tmp_path, monkeypatch):
    from pipelines.training import trackers

    (tmp_path / "tensorboard").mkdir()
    monkeypatch.setattr(trackers.os, "access", lambda path, mode: False)  # what a read-only folder answers (not root)
    with pytest.raises(UsageError, match=r"--report-to tensorboard: .*tensorboard cannot be written \(read-only\)"):
        trackers.check_trackers("tensorboard", tmp_path)


@pytest.mark.parametrize("parent", ["file", "read-only"])
def test_an_out_whose_parent_cannot_hold_it_is_one_line_before_any_work(tiny, corpus, tmp_path, capsys,
                                                                         monkeypatch, parent):
    if parent == "file":
        (tmp_path / "parent").write_text("a file")
    else:
        def refuse(self, *args, **kwargs):
            raise PermissionError(13, "Permission denied", str(self))
        monkeypatch.setattr(Path, "mkdir", refuse)  # what a read-only parent answers (root writes anywhere)
    out = tmp_path / "parent" / "run"
    code, _, err = run_cli(["bcd", *tiny, "--data", corpus, "--out", str(out)], capsys)
    assert code == 1 and f"--out {out}: cannot create the directory" in failure_line(err)


@pytest.mark.slow
def test_a_store_dir_held_by_another_run_is_refused_naming_the_holder(tiny, corpus, tmp_path, capsys):
    stores = tmp_path / "stores"
    holder = hold(stores)
    try:
        code, _, err = run_cli(["bcd", *tiny, "--data", corpus, "--pre-inference", "on", "--store-dir", str(stores),
                                "--out", str(tmp_path / "run")], capsys)
    finally:
        holder.stdin.close()
        holder.wait()
    assert code == 1 and f"--store-dir {stores} is held by another job (pid {holder.pid} on host {HOST})" in \
        failure_line(err)


@pytest.mark.parametrize("boundary", [0, -1, 5])
def test_load_store_suffix_outside_the_layers_is_one_line(boundary):
    with pytest.raises(UsageError, match=rf"boundary {boundary} is outside \[1, 4\]"):
        load_store_suffix("tiny-llama", boundary)


# ---- inputs are what the user means ----


def test_a_save_to_disk_folder_reads_only_the_files_its_state_names(tmp_path):
    dataset = datasets.Dataset.from_list([{"text": f"document {i}"} for i in range(5)])
    dataset.save_to_disk(tmp_path / "saved")
    datasets.load_from_disk(tmp_path / "saved").map(lambda r: {"text": r["text"] + " mapped"},
                                                     cache_file_name=str(tmp_path / "saved" / "cache-1.arrow"))
    assert (tmp_path / "saved" / "cache-1.arrow").is_file()
    assert read_documents(str(tmp_path / "saved")) == [f"document {i}" for i in range(5)]


def test_a_dataset_repository_trains_on_its_train_split(tmp_path):
    (tmp_path / "repo" / "data").mkdir(parents=True)
    for split in ("train", "test", "validation"):
        datasets.Dataset.from_list([{"text": f"{split} {i}"} for i in range(3)]).to_parquet(
            tmp_path / "repo" / "data" / f"{split}-00000-of-00001.parquet")
    assert read_documents(str(tmp_path / "repo")) == ["train 0", "train 1", "train 2"]
    assert read_documents(str(tmp_path / "repo"), split="test") == ["test 0", "test 1", "test 2"]
    with pytest.raises(UsageError, match=r"holds the splits \['test', 'train', 'validation'\], not 'other'"):
        read_documents(str(tmp_path / "repo"), split="other")


def test_a_byte_order_mark_is_not_text(tmp_path):
    (tmp_path / "a.txt").write_bytes("\ufefffirst\n\nsecond".encode())
    (tmp_path / "a.jsonl").write_bytes("\ufeff".encode() + b'{"text": "first"}\n')
    assert read_documents(str(tmp_path / "a.txt")) == ["first", "second"]
    assert read_documents(str(tmp_path / "a.jsonl")) == ["first"]


@pytest.mark.parametrize("char", ["\u2028", "\u0085", "\u2029", "\x1c", "\r"])
def test_jsonl_is_split_at_newlines_only(tmp_path, char):
    path = tmp_path / "a.jsonl"
    path.write_bytes(json.dumps({"text": f"one{char}line"}, ensure_ascii=False).encode() + b"\r\n"
                     + json.dumps({"text": "two"}).encode() + b"\n")
    assert read_documents(str(path)) == [f"one{char}line", "two"]


def test_a_file_without_an_extension_is_text_and_an_unknown_one_is_named(tmp_path):
    (tmp_path / "LICENSE").write_text("Permission is granted.\n\nNo warranty.")
    assert read_documents(str(tmp_path / "LICENSE")) == ["Permission is granted.", "No warranty."]
    (tmp_path / "data.csv").write_text("a,b")
    with pytest.raises(UsageError, match=r"data\.csv: unknown data file extension '\.csv'"):
        read_documents(str(tmp_path / "data.csv"))


def test_a_fifo_as_data_is_one_line(tmp_path):
    os.mkfifo(tmp_path / "data.txt")
    with pytest.raises(UsageError, match="is not a regular file"):
        read_documents(str(tmp_path / "data.txt"))


def test_huggingface_named_templates_take_default_or_the_one_named(chat_tokenizer, tmp_path):
    named = [{"name": "tool_use", "template": "{{ 'tools' }}"}, {"name": "default", "template": CHATML}]
    (tmp_path / "t.json").write_text(json.dumps({"chat_template": named}))
    assert load_tokenizer(str(chat_tokenizer), str(tmp_path / "t.json")).chat_template == CHATML
    assert load_tokenizer(str(chat_tokenizer), f"{tmp_path / 't.json'}#tool_use").chat_template == "{{ 'tools' }}"
    with pytest.raises(UsageError, match=r"no chat template named 'nope' \(it has default, tool_use\)"):
        load_tokenizer(str(chat_tokenizer), f"{tmp_path / 't.json'}#nope")


def test_a_conversation_that_starts_with_the_assistant_is_refused_naming_its_line(chat_tokenizer, tmp_path):
    records = [CHAT[0], {"messages": [{"role": "assistant", "content": "hello"}, {"role": "user", "content": "hi"}]}]
    data = write_jsonl(tmp_path / "chat.jsonl", records)
    with pytest.raises(UsageError, match=rf"^{data}:2: the conversation starts with the assistant's turn"):
        load_data(data, load_tokenizer(str(chat_tokenizer)), 64)


# ---- hostile templates ----


@pytest.mark.parametrize("name, template, error", [
    ("division", "{{ 1 / 0 }}", "ZeroDivisionError"),
    ("type", "{{ messages + 1 }}", "TypeError"),
    ("range", "{% for i in range(10**9) %}x{% endfor %}", "OverflowError"),
    ("include", "{% include 'other.jinja' %}", "no loader"),
    ("import", "{% import 'other.jinja' as other %}", "no loader"),
    ("extends", "{% extends 'other.jinja' %}", "no loader"),
    ("raise", "{{ raise_exception('roles must alternate') }}", "roles must alternate"),
    # templates that would blow up: each bound of pipelines.data.template_bounds
    ("nested loops", "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", "steps"),
    ("nested loops with output", "{% for i in range(100000) %}{% for j in range(100000) %}xxxxxxxx{% endfor %}"
                                 "{% endfor %}", "TemplateLimitError"),
    ("a huge product", "{{ 'x' * 2000000000 }}", "characters (or items)"),
    ("a product of names", "{% set n = 20 ** 7 %}{{ 'x' * n }}", "characters (or items)"),
    ("doubling", "{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}"
                 "{{ ns.s }}", "characters (or items)"),
    ("a huge width", "{{ 'x'|center(2000000000) }}", "a width or count"),
    ("a huge method width", "{{ 'x'.ljust(2000000000) }}", "a width or count"),
    ("a huge format width", "{{ '%2000000000s' % 'x' }}", "a width or count"),
    ("a huge field width", "{{ '{:>2000000000}'.format('x') }}", "a width or count"),
    ("a huge power", "{{ 7 ** 100000000 }}", "bits"),
    ("recursion", "{% macro f(n) %}{{ f(n) }}{{ f(n) }}{% endmacro %}{{ f(1) }}", "RecursionError"),
])
def test_a_template_that_raises_is_one_line_naming_the_record_and_exit_2(chat_tokenizer, tmp_path, capsys, name,
                                                                          template, error):
    data = write_jsonl(tmp_path / "chat.jsonl", CHAT)
    (tmp_path / "t.jinja").write_text(template)
    before = peak_rss()
    code, _, err = run_cli(["tokenize", "--data", data, "--tokenizer", str(chat_tokenizer), "--chat-template",
                            str(tmp_path / "t.jinja"), "--quiet", "--out", str(tmp_path / "tokens")], capsys)
    line = failure_line(err)
    assert code == 2 and f"{data}:1: the chat template cannot render" in line and error in line, line
    assert peak_rss() - before < RSS_GROWTH  # memory stays bounded
    assert not (tmp_path / "tokens").exists()


@pytest.mark.parametrize("tag", ["{% generation %}", "{%- generation -%}", "{%generation%}"])
def test_generation_marks_give_transformers_own_mask_however_spelled(tmp_path, tag):
    template = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' }}{% if m['role'] == 'assistant' %}"
                f"{tag}{{{{ m['content'] + '<|im_end|>' }}}}{{% endgeneration %}}{{% else %}}"
                "{{ m['content'] + '<|im_end|>' }}{% endif %}{% endfor %}")
    directory = save_tokenizer(tmp_path / "tok", template)
    conversation = Conversation((("user", "hi"), ("assistant", "hello"), ("user", "more"), ("assistant", "yes")))
    ours = render_conversations(load_tokenizer(str(directory)), [conversation])[0]
    theirs = AutoTokenizer.from_pretrained(directory).apply_chat_template(
        conversation.messages(), return_dict=True, return_assistant_tokens_mask=True)
    assert (ours.ids.tolist(), ours.mask.tolist()) == (theirs["input_ids"], theirs["assistant_masks"])
    assert sum(ours.mask.tolist()) > 0


def test_a_template_over_256_kib_is_refused_before_it_is_compiled(chat_tokenizer, tmp_path, monkeypatch):
    import transformers.utils.chat_template_utils as chat_utils

    monkeypatch.setattr(chat_utils, "_compile_jinja_template", lambda *a: pytest.fail("the template was compiled"))
    (tmp_path / "big.jinja").write_text("x" * (MAX_TEMPLATE_BYTES + 1))
    with pytest.raises(UsageError, match=r"big\.jinja: 262145 bytes, over the 256 KiB"):
        load_tokenizer(str(chat_tokenizer), str(tmp_path / "big.jinja"))
    (tmp_path / "big.json").write_text(json.dumps({"chat_template": "x" * (2 << 20)}))
    with pytest.raises(UsageError, match="over the 256 KiB"):
        load_tokenizer(str(chat_tokenizer), str(tmp_path / "big.json"))
