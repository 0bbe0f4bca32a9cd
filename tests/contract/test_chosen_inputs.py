"""The contract, round two, continued (issue 36): a run reads the dataset split and the named chat template it is
asked for, and nothing else; a conversation the template cannot render is refused naming its record or, when asked,
skipped and counted; a bounded template renders as Jinja's own sandbox does (the hostile ones are round two's);
and a run reads its corpus once for its fingerprint."""

import json
from pathlib import Path

import datasets
import pytest
from jinja2.sandbox import ImmutableSandboxedEnvironment
from transformers import AutoTokenizer
from transformers.utils import chat_template_utils

from tests.helpers.chat_templates import CHATML, save_tokenizer
from tests.helpers.cli_run import failure_line, run_cli
import pipelines.data.corpus as corpus_module
from pipelines.data import template_bounds
from pipelines.data.chat import render_conversations
from pipelines.data.conversations import Conversation
from pipelines.data.corpus import read_documents
from pipelines.data.token_store import token_fingerprint
from pipelines.data.token_store.layout import INFO
from pipelines.data.template_bounds import BoundedSandbox
from pipelines.data.tokenizers import ByteTokenizer, load_tokenizer
from preinfer.errors import UsageError

CHAT = [{"messages": [{"role": "user", "content": f"question {i}?"}, {"role": "assistant", "content": f"answer {i}"}]}
        for i in range(6)]
ASSISTANT_FIRST = {"messages": [{"role": "assistant", "content": "hello"}, {"role": "user", "content": "hi"}]}
TOOLS = "{% for m in messages %}{{ '[' + m['role'] + '] ' + m['content'] + '<|im_end|>' }}{% endfor %}"


def write_jsonl(path: Path, records: list) -> str:
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return str(path)


@pytest.fixture(scope="module")
def repo(tmp_path_factory) -> Path:
    """A local dataset repository: data/{train,test,validation}-00000-of-00001.parquet, 40 paragraphs each."""
    root = tmp_path_factory.mktemp("repo") / "repo"
    (root / "data").mkdir(parents=True)
    for split in ("train", "test", "validation"):
        rows = [{"text": f"{split} document {i}: " + "some words of text " * 8} for i in range(40)]
        datasets.Dataset.from_list(rows).to_parquet(root / "data" / f"{split}-00000-of-00001.parquet")
    return root


@pytest.fixture(scope="module")
def named(tmp_path_factory) -> Path:
    """A tokenizer whose own chat templates are named: `default` (ChatML) and `tool_use`."""
    directory = save_tokenizer(tmp_path_factory.mktemp("tok") / "named", CHATML)
    tokenizer = AutoTokenizer.from_pretrained(directory)
    tokenizer.chat_template = {"default": CHATML, "tool_use": TOOLS}
    tokenizer.save_pretrained(directory)
    return directory


def tokenize(argv: list[str], capsys) -> tuple[int, str, str]:
    return run_cli(["tokenize", "--quiet", "--seq-len", "16", *argv], capsys)


# ---- item 1: --dataset-split ----


def test_the_dataset_split_asked_for_is_read_and_makes_another_token_store(repo, tmp_path, capsys):
    assert read_documents(str(repo))[0].startswith("train document 0")
    assert read_documents(str(repo), split="validation")[0].startswith("validation document 0")
    code, out, err = tokenize(["--data", str(repo), "--dataset-split", "test", "--out", str(tmp_path / "t"),
                               "--json"], capsys)
    assert code == 0, err
    info = json.loads((tmp_path / "t" / INFO).read_text())
    assert info["fingerprint"]["parts"]["dataset_split"] == "test"
    byte = ByteTokenizer()
    digests = {split: token_fingerprint(str(repo), byte, 16, 0.1, dataset_split=split).digest
               for split in ("train", "test", "validation")}
    assert info["fingerprint"]["digest"] == digests["test"] and len(set(digests.values())) == 3


def test_a_token_store_of_another_dataset_split_is_refused_in_one_line(repo, tmp_path, capsys):
    assert tokenize(["--data", str(repo), "--out", str(tmp_path / "t")], capsys)[0] == 0
    code, _, err = run_cli(["eval", "--model", "tiny-llama", "--data", str(tmp_path / "t"), "--seq-len", "16",
                            "--dataset-split", "test", "--json"], capsys)
    assert code == 2 and "is a token store of the dataset split 'train', not of --dataset-split test" in \
        failure_line(err)


@pytest.mark.parametrize("kind", ["repository", "DatasetDict"])
def test_a_missing_dataset_split_is_one_line_naming_the_splits(repo, tmp_path, capsys, kind):
    data = repo
    if kind == "DatasetDict":
        data = tmp_path / "dict"
        datasets.DatasetDict({name: datasets.Dataset.from_list([{"text": name}]) for name in ("train", "test")}
                             ).save_to_disk(data)
        capsys.readouterr()  # the progress bars of save_to_disk
    code, _, err = tokenize(["--data", str(data), "--dataset-split", "dev2", "--out", str(tmp_path / "t")], capsys)
    line = failure_line(err)
    assert code == 2 and "'dev2'" in line and "--dataset-split" in line
    assert ("['test', 'train', 'validation']" if kind == "repository" else "['train', 'test']") in line
    assert not (tmp_path / "t").exists()


def test_a_split_of_a_corpus_without_splits_is_refused(corpus, tmp_path, capsys):
    for data in (corpus, "builtin:pydoc"):
        code, _, err = tokenize(["--data", data, "--dataset-split", "test", "--out", str(tmp_path / "t")], capsys)
        assert code == 2 and f"--dataset-split test: {data} has no splits" in failure_line(err)
    with pytest.raises(UsageError, match="has no splits"):
        read_documents(corpus, split="validation")


@pytest.mark.parametrize("value", ["../train", "a b", ""])
def test_a_dataset_split_that_is_not_a_split_name_is_refused_before_anything_runs(tmp_path, capsys, value):
    code, _, err = run_cli(["bcd", "--dataset-split", value, "--out", str(tmp_path / "run")], capsys)
    assert code == 2 and "expected a split name" in failure_line(err)
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_a_run_records_its_dataset_split_and_resume_refuses_another(tiny, repo, tmp_path, capsys):
    out = tmp_path / "run"
    code, _, err = run_cli(["bcd", *tiny, "--data", str(repo), "--dataset-split", "validation", "--out", str(out)],
                           capsys)
    assert code == 0, err
    assert json.loads((out / "inputs.json").read_text())["dataset_split"] == "validation"
    code, _, err = run_cli(["bcd", "--out", str(out), "--resume", "--dataset-split", "train"], capsys)
    assert code == 2 and "[data] dataset_split 'validation' -> 'train'" in failure_line(err)


# ---- item 2: --chat-template-name ----


def test_a_tokenizer_s_named_templates_take_default_or_the_one_named(named):
    default, tools = load_tokenizer(str(named)), load_tokenizer(str(named), chat_template_name="tool_use")
    assert (default.chat_template, tools.chat_template) == (CHATML, TOOLS)
    assert default.fingerprint() != tools.fingerprint()  # the template is part of the tokenizer's fingerprint
    with pytest.raises(UsageError, match=r"no chat template named 'nope' \(it has default, tool_use\); pass "
                                         r"--chat-template-name NAME"):
        load_tokenizer(str(named), chat_template_name="nope")


def test_tokenizer_config_s_list_of_named_templates_is_understood_default_first(tmp_path):
    directory = save_tokenizer(tmp_path / "tok")
    config = json.loads((directory / "tokenizer_config.json").read_text())
    config["chat_template"] = [{"name": "tool_use", "template": TOOLS}, {"name": "default", "template": CHATML}]
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    assert load_tokenizer(str(directory)).chat_template == CHATML
    assert load_tokenizer(str(directory), chat_template_name="tool_use").chat_template == TOOLS


def test_a_named_template_renders_the_token_store_and_an_unknown_name_is_one_line(named, tmp_path, capsys):
    data = write_jsonl(tmp_path / "chat.jsonl", CHAT)
    code, _, err = tokenize(["--data", data, "--tokenizer", str(named), "--chat-template-name", "tool_use",
                             "--seq-len", "64", "--out", str(tmp_path / "t")], capsys)
    assert code == 0, err
    stored = json.loads((tmp_path / "t" / INFO).read_text())["fingerprint"]["parts"]["tokenizer_digest"]
    assert stored == load_tokenizer(str(named), chat_template_name="tool_use").fingerprint()
    code, _, err = tokenize(["--data", data, "--tokenizer", str(named), "--chat-template-name", "nope",
                             "--out", str(tmp_path / "u")], capsys)
    assert code == 2 and "no chat template named 'nope' (it has default, tool_use)" in failure_line(err)


def test_a_template_name_without_named_templates_or_beside_a_template_file_is_refused(tmp_path, capsys):
    single = save_tokenizer(tmp_path / "single", CHATML)
    with pytest.raises(UsageError, match="has one chat template, not named ones"):
        load_tokenizer(str(single), chat_template_name="default")
    with pytest.raises(UsageError, match="needs a Hugging Face tokenizer"):
        load_tokenizer("byte", chat_template_name="default")
    (tmp_path / "t.jinja").write_text(CHATML)
    code, _, err = run_cli(["bcd", "--chat-template", str(tmp_path / "t.jinja"), "--chat-template-name", "x",
                            "--out", str(tmp_path / "run")], capsys)
    assert code == 2 and "expected unset with --chat-template" in failure_line(err)


# ---- item 3: --skip-unrenderable ----


def test_an_unrenderable_conversation_is_refused_naming_it_or_skipped_and_counted(tmp_path, capsys):
    tokenizer = save_tokenizer(tmp_path / "tok", CHATML)
    data = write_jsonl(tmp_path / "chat.jsonl", [*CHAT[:3], ASSISTANT_FIRST, *CHAT[3:]])
    argv = ["--data", data, "--tokenizer", str(tokenizer), "--seq-len", "64", "--eval-fraction", "0"]
    code, _, err = tokenize([*argv, "--out", str(tmp_path / "refused")], capsys)
    line = failure_line(err)
    assert code == 2 and f"error: {data}:4: the conversation starts with the assistant's turn" in line
    assert "--skip-unrenderable" in line and "Traceback" not in err
    code, out, err = tokenize([*argv, "--skip-unrenderable", "--out", str(tmp_path / "t")], capsys)
    assert code == 0 and "1 conversations skipped" in out, err
    info = json.loads((tmp_path / "t" / INFO).read_text())
    assert (info["splits"]["train"]["samples"], info["splits"]["train"]["skipped"]) == (6, 1)
    assert info["fingerprint"]["parts"]["skip_unrenderable"] is True


def test_skipping_leaves_out_only_the_conversations_the_template_refuses(tmp_path):
    tokenizer = load_tokenizer(str(save_tokenizer(tmp_path / "tok", CHATML)))
    conversations = [Conversation((("user", "hi"), ("assistant", "yes")), where="r:1"),
                     Conversation((("assistant", "first"), ("user", "then")), where="r:2")]
    kept = render_conversations(tokenizer, conversations, skip_unrenderable=True)
    assert len(kept) == 1
    assert kept[0].ids.tolist() == render_conversations(tokenizer, conversations[:1])[0].ids.tolist()


# ---- item 4: templates stay bounded (the hostile cases: tests/contract/test_round_two.py) ----


def test_a_bounded_template_renders_as_jinja_s_own_sandbox_renders_it(tmp_path):
    template = CHATML + ("{{ '-' * 8 + ('%d' % 1700000000) + ('a' ~ 'b') + '{:>3}'.format(7) + ' '.join(['x', 'y']) "
                         "| upper }}")
    directory = save_tokenizer(tmp_path / "tok", template)
    conversation = Conversation((("user", "hi"), ("assistant", "hello")))
    template_bounds.install()
    assert isinstance(chat_template_utils._compile_jinja_template(template).environment, BoundedSandbox)
    ours = load_tokenizer(str(directory)).backend.apply_chat_template(conversation.messages(), tokenize=False)
    theirs = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True).from_string(template).render(
        messages=conversation.messages(), add_generation_prompt=False)
    assert ours == theirs and ours.endswith("--------1700000000ab  7X Y")


# ---- item 5: the corpus is read once for its fingerprint ----


@pytest.mark.slow
def test_a_run_reads_its_corpus_once_for_its_fingerprint_at_start_and_on_resume(tiny, corpus, tmp_path, capsys,
                                                                                 monkeypatch):
    reads = []
    digest = corpus_module._file_digest
    monkeypatch.setattr(corpus_module, "_file_digest", lambda path: reads.append(path) or digest(path))
    out = tmp_path / "run"
    code, _, err = run_cli(["bcd", *tiny, "--data", corpus, "--out", str(out)], capsys)
    assert code == 0, err
    assert reads == [Path(corpus)]
    reads.clear()
    code, _, err = run_cli(["bcd", "--out", str(out), "--resume", "--sweeps", "2"], capsys)
    assert code == 0, err
    assert reads == [Path(corpus)]
