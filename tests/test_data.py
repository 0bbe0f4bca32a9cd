"""Data side: tokenizers, packing, instruction masking, splits, fingerprints and bad input."""

from __future__ import annotations

import json
import logging
import random
from pathlib import Path

import pytest
import torch

from pipelines.data.corpus import read_documents
from pipelines.data.sample_blocks import IGNORE_INDEX
from pipelines.data.samples import format_prompt, in_eval_split
from pipelines.data.in_memory import TokenDataset, load_data, sample_blocks
from preinfer.presets import BYTE_EOS_ID, BYTE_PAD_ID, BYTE_VOCAB_SIZE
from pipelines.data.tokenizers import load_tokenizer
from tests.helpers.corpus_samples import CASES, write_corpora
from tests.helpers.one_line_errors import raises_one_line
from tests.helpers.word_tokenizer import CORPUS, save_word_tokenizer

BYTE = load_tokenizer("byte")
EOS = BYTE_EOS_ID


def write_jsonl(path: Path, records: list) -> Path:
    path.write_text("".join(json.dumps(record) + "\n" for record in records), encoding="utf-8")
    return path


def byte_ids(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def split_documents(dataset: TokenDataset) -> list[str]:
    """The complete documents of a packed byte-level dataset: the text before each eos (packing starts a document)."""
    pieces, current = [], []
    for token in dataset.input_ids.reshape(-1).tolist():
        if token == EOS:
            pieces.append(BYTE.decode(current))
            current = []
        else:
            current.append(token)
    return pieces


# ---- byte tokenizer ----


def test_byte_tokenizer_round_trip_and_constants():
    text = "héllo, wörld ✓ 🐍"
    ids = BYTE.encode(text)
    assert ids == byte_ids(text)
    assert BYTE.decode(ids + [BYTE_PAD_ID, EOS]) == text
    assert (BYTE.name, BYTE.vocab_size, BYTE.pad_id, BYTE.eos_id) == ("byte", BYTE_VOCAB_SIZE, BYTE_PAD_ID, EOS)
    assert BYTE.fingerprint() == load_tokenizer().fingerprint()
    assert len(BYTE.fingerprint()) == 64


# ---- LM text: packing ----


def test_txt_paragraphs_are_documents_packed_with_eos(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text("alpha beta\n  indented line\n\n\n   \ngamma\n\ndelta epsilon zeta\n", encoding="utf-8")
    assert read_documents(str(path)) == ["alpha beta\n  indented line", "gamma", "delta epsilon zeta"]
    data = load_data(str(path), BYTE, seq_len=8, eval_fraction=0.0)
    stream = byte_ids("alpha beta\n  indented line") + [EOS] + byte_ids("gamma") + [EOS]
    stream += byte_ids("delta epsilon zeta") + [EOS]
    usable = len(stream) // 8 * 8
    assert data.input_ids.dtype == torch.int64 and data.labels.dtype == torch.int64
    assert data.attention_mask.dtype == torch.bool
    assert data.input_ids.shape == (len(stream) // 8, 8)
    assert data.input_ids.reshape(-1).tolist() == stream[:usable]
    assert torch.equal(data.labels, data.input_ids)
    assert bool(data.attention_mask.all())
    assert data.num_tokens == usable
    assert (data.source, data.split, len(data)) == (str(path), "train", len(stream) // 8)


def test_text_jsonl_and_directory_sources(tmp_path):
    write_jsonl(tmp_path / "b.jsonl", [{"text": "second file", "meta": 1}])
    (tmp_path / "a.txt").write_text("first file\n", encoding="utf-8")
    (tmp_path / "notes.md").write_text("ignored", encoding="utf-8")
    assert read_documents(str(tmp_path / "b.jsonl")) == ["second file"]
    assert read_documents(str(tmp_path)) == ["first file", "second file"]
    data = load_data(str(tmp_path), BYTE, seq_len=4, eval_fraction=0.0)
    stream = byte_ids("first file") + [EOS] + byte_ids("second file") + [EOS]
    assert data.input_ids.reshape(-1).tolist() == stream[:20]


def test_pydoc_has_train_and_eval_at_default_lengths():
    documents = read_documents("builtin:pydoc")
    total = sum(len(doc.encode()) + 1 for doc in documents)
    for seq_len in (128, 256):
        train = load_data("builtin:pydoc", BYTE, seq_len, "train")
        evaluation = load_data("builtin:pydoc", BYTE, seq_len, "eval")
        assert len(train) > 0 and len(evaluation) > 0
        assert len(evaluation) < len(train)
        assert total - 2 * seq_len < train.num_tokens + evaluation.num_tokens <= total


# Fingerprints and sample counts of load_data on the sample corpora, computed by the in-memory implementation that
# read each file whole (commit f2ba3c1): the streaming readers and packer must give the very same samples.
PINNED = {
    ("txt", "train"): ("846ab8a18f92bf6c5e247c9352fa190ed4dd6300f7a9432ea49f0d6e4b1495ba", 214),
    ("txt", "eval"): ("b2ec2dcb4f793b2a500b93744aed28e1dce7415cdfa449298d0baee5bb1351a2", 46),
    ("jsonl", "train"): ("62682cf7ff48ea0144793a5abcdbe786a6e04ff5f52325de7cd07c3b5146cfbb", 315),
    ("jsonl", "eval"): ("eb28da73a8f7b4915670282e018fa48901b47fb85fc91e7f4d47f687c268d9b8", 49),
    ("instruction", "train"): ("5e17411c60f1b6fb8f6c5c8f1965a23fd495005f1d8a49ee915082656bf149ac", 50),
    ("instruction", "eval"): ("e9a71511fb571524b2501822ba7b1f0e57a37e25763fc0f9e1c2d12a1f4d4306", 23),
    ("directory", "train"): ("fe80cf78ea31434eb8ade23b2cdf82bbce8a6e1e746618409f852274af9ba757", 281),
    ("directory", "eval"): ("6e2c203bb5744f484d808ed3263456479f60c5dda987e7aea26a7fcc26733a23", 150),
}


@pytest.mark.parametrize("name,seq_len,eval_fraction", CASES)
def test_samples_are_those_of_the_whole_file_reader(tmp_path, name, seq_len, eval_fraction):
    path = str(write_corpora(tmp_path)[name])
    for split in ("train", "eval"):
        data = load_data(path, BYTE, seq_len, split, eval_fraction)
        assert (data.fingerprint(), len(data)) == PINNED[name, split]
        blocks = list(sample_blocks(path, BYTE, seq_len, split, eval_fraction, block_samples=7))
        assert [len(block) for block in blocks[:-1]] == [7] * (len(blocks) - 1) and 0 < len(blocks[-1]) <= 7
        for key, tensor in data[:].items():
            assert torch.equal(torch.cat([block.tensors()[key] for block in blocks]), tensor), key


def test_pydoc_documents_are_its_topics_in_key_order():
    from pydoc_data.topics import topics

    assert read_documents("builtin:pydoc") == [topics[key] for key in sorted(topics)]


# ---- train/eval split ----


def test_split_is_deterministic_disjoint_and_order_independent(tmp_path):
    documents = [f"document number {i:03d}" for i in range(300)]
    write_jsonl(tmp_path / "ordered.jsonl", [{"text": doc} for doc in documents])
    shuffled = documents[:]
    random.Random(0).shuffle(shuffled)
    write_jsonl(tmp_path / "shuffled.jsonl", [{"text": doc} for doc in shuffled])

    expected_eval = {doc for doc in documents if in_eval_split(doc, 0.2)}
    assert 0 < len(expected_eval) < len(documents)
    for name in ("ordered.jsonl", "shuffled.jsonl"):
        train = load_data(str(tmp_path / name), BYTE, seq_len=16, split="train", eval_fraction=0.2)
        evaluation = load_data(str(tmp_path / name), BYTE, seq_len=16, split="eval", eval_fraction=0.2)
        train_docs, eval_docs = set(split_documents(train)), set(split_documents(evaluation))
        assert not train_docs & eval_docs
        assert eval_docs <= expected_eval and len(eval_docs) >= len(expected_eval) - 1
        assert train_docs <= set(documents) - expected_eval
        assert len(train_docs) >= len(documents) - len(expected_eval) - 1

    first = load_data(str(tmp_path / "ordered.jsonl"), BYTE, seq_len=16, split="eval", eval_fraction=0.2)
    again = load_data(str(tmp_path / "ordered.jsonl"), BYTE, seq_len=16, split="eval", eval_fraction=0.2)
    assert torch.equal(again.input_ids, first.input_ids) and again.fingerprint() == first.fingerprint()


# ---- instruction data ----


def test_instruction_masking_and_right_padding(tmp_path):
    records = [
        {"instruction": "Add the numbers.", "input": "2 and 3", "output": "5"},
        {"instruction": "Say hi.", "output": "hi there"},
    ]
    path = write_jsonl(tmp_path / "sft.jsonl", records)
    data = load_data(str(path), BYTE, seq_len=96, eval_fraction=0.0)
    assert len(data) == 2
    for row, record in enumerate(records):
        prompt = byte_ids(format_prompt(record["instruction"], record.get("input", "")))
        response = byte_ids(record["output"]) + [EOS]
        length = len(prompt) + len(response)
        assert data.input_ids[row].tolist() == prompt + response + [BYTE_PAD_ID] * (96 - length)
        assert data.labels[row].tolist() == [IGNORE_INDEX] * len(prompt) + response + [IGNORE_INDEX] * (96 - length)
        assert data.attention_mask[row].tolist() == [True] * length + [False] * (96 - length)
    assert data.num_tokens == int(data.attention_mask.sum())
    assert format_prompt("Say hi.") == "### Instruction:\nSay hi.\n\n### Response:\n"
    assert "### Input:\n2 and 3\n\n" in format_prompt("Add.", "2 and 3")


def test_instruction_truncation_and_dropped_examples(tmp_path, caplog):
    short_prompt = format_prompt("Echo.")
    records = [
        {"instruction": "Echo.", "output": "x" * 100},
        {"instruction": "y" * 100, "output": "never seen"},
    ]
    path = write_jsonl(tmp_path / "sft.jsonl", records)
    with caplog.at_level(logging.WARNING, logger="pipelines.data.sample_blocks"):
        data = load_data(str(path), BYTE, seq_len=40, eval_fraction=0.0)
    assert "dropped 1 of 2" in caplog.text
    assert len(data) == 1
    prompt_len = len(short_prompt.encode())
    assert data.input_ids[0].tolist() == (byte_ids(short_prompt) + byte_ids("x" * 100))[:40]
    assert data.labels[0, :prompt_len].eq(IGNORE_INDEX).all()
    assert data.labels[0, prompt_len:].tolist() == [ord("x")] * (40 - prompt_len)
    assert data.attention_mask[0].all()

    write_jsonl(path, records[1:])
    with raises_one_line(r"no instruction example left .*seq_len=40"):
        load_data(str(path), BYTE, seq_len=40, eval_fraction=0.0)


def test_instruction_split_is_by_example(tmp_path):
    records = [{"instruction": f"task {i}", "output": f"answer {i}"} for i in range(60)]
    path = write_jsonl(tmp_path / "sft.jsonl", records)
    train = load_data(str(path), BYTE, seq_len=64, split="train", eval_fraction=0.3)
    evaluation = load_data(str(path), BYTE, seq_len=64, split="eval", eval_fraction=0.3)
    assert len(train) + len(evaluation) == 60 and len(evaluation) > 0
    rows = {tuple(row) for row in train.input_ids.tolist()}
    assert not rows & {tuple(row) for row in evaluation.input_ids.tolist()}


# ---- TokenDataset ----


def test_getitem_keeps_the_batch_axis():
    ids = torch.arange(12, dtype=torch.int64).reshape(4, 3)
    data = TokenDataset(ids, torch.ones(4, 3, dtype=torch.bool), ids.clone(), source="x", split="train")
    assert set(data[0]) == {"input_ids", "attention_mask", "labels"}
    assert data[0]["input_ids"].tolist() == [[0, 1, 2]]
    assert data[-1]["labels"].tolist() == [[9, 10, 11]]
    assert data[torch.tensor(2)]["input_ids"].shape == (1, 3)
    assert data[1:3]["input_ids"].tolist() == [[3, 4, 5], [6, 7, 8]]
    assert data[torch.tensor([3, 0])]["input_ids"][:, 0].tolist() == [9, 0]
    assert data[[1]]["attention_mask"].shape == (1, 3)
    with pytest.raises(IndexError):
        data[4]


def test_dataset_fingerprint_is_stable_and_content_sensitive(tmp_path):
    ids = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]])
    data = TokenDataset(ids, torch.ones(2, 4, dtype=torch.bool), ids.clone(), source="a", split="train")
    # Pinned: the hash depends only on the content (no process-dependent state), so it is the same in every run.
    assert data.fingerprint() == "058e1fed8d2439c8b5f2ef52dd1057d8ff48938f044edccbce5c199af61a9935"
    renamed = TokenDataset(ids.clone(), torch.ones(2, 4, dtype=torch.bool), ids.clone(), source="b", split="train")
    assert renamed.fingerprint() == data.fingerprint()
    assert TokenDataset(ids, data.attention_mask, ids, "a", "eval").fingerprint() != data.fingerprint()
    changed = ids.clone()
    changed[1, 3] = 9
    assert TokenDataset(changed, data.attention_mask, changed, "a", "train").fingerprint() != data.fingerprint()
    reshaped = ids.reshape(4, 2)
    assert TokenDataset(reshaped, torch.ones(4, 2, dtype=torch.bool), reshaped, "a", "train").fingerprint() != (
        data.fingerprint()
    )

    path = tmp_path / "c.txt"
    path.write_text("one paragraph of text\n\nanother paragraph here\n", encoding="utf-8")
    first = load_data(str(path), BYTE, seq_len=8, eval_fraction=0.0).fingerprint()
    assert load_data(str(path), BYTE, seq_len=8, eval_fraction=0.0).fingerprint() == first
    assert load_data(str(path), BYTE, seq_len=9, eval_fraction=0.0).fingerprint() != first
    path.write_text("ONE paragraph of text\n\nanother paragraph here\n", encoding="utf-8")
    assert load_data(str(path), BYTE, seq_len=8, eval_fraction=0.0).fingerprint() != first


# ---- Hugging Face tokenizer directory ----


def test_hf_tokenizer_directory(tmp_path):
    directory = save_word_tokenizer(tmp_path / "tok", CORPUS)
    tok = load_tokenizer(str(directory))
    assert tok.name == str(directory)
    assert tok.vocab_size == len(set(" ".join(CORPUS).split())) + 3
    assert (tok.eos_id, tok.pad_id) == (1, 2)
    ids = tok.encode("the cat ran")
    assert len(ids) == 3 and tok.eos_id not in ids
    assert tok.decode(ids + [tok.eos_id]) == "the cat ran"
    assert load_tokenizer(str(directory)).fingerprint() == tok.fingerprint()
    fingerprint = tok.fingerprint()
    tok._tok("the cat sat on the mat", truncation=True, max_length=2)  # per-call state must not change it
    assert tok.fingerprint() == fingerprint
    other = load_tokenizer(str(save_word_tokenizer(tmp_path / "other", CORPUS[:2])))
    assert other.fingerprint() != tok.fingerprint()

    text = tmp_path / "t.txt"
    text.write_text("the cat sat\n\na dog ran in the park\n", encoding="utf-8")
    data = load_data(str(text), tok, seq_len=5, eval_fraction=0.0)
    stream = tok.encode("the cat sat") + [tok.eos_id] + tok.encode("a dog ran in the park") + [tok.eos_id]
    assert data.input_ids.reshape(-1).tolist() == stream[:10]

    sft = write_jsonl(tmp_path / "s.jsonl", [{"instruction": "the cat", "output": "sat"}])
    example = load_data(str(sft), tok, seq_len=16, eval_fraction=0.0)
    prompt_len = len(tok.encode(format_prompt("the cat")))
    length = prompt_len + 2
    assert example.labels[0, prompt_len:length].tolist() == tok.encode("sat") + [tok.eos_id]
    assert example.input_ids[0, length:].eq(tok.pad_id).all()
    assert example.labels[0, :prompt_len].eq(IGNORE_INDEX).all() and example.labels[0, length:].eq(IGNORE_INDEX).all()


def test_hf_tokenizer_pad_falls_back_to_eos(tmp_path):
    tok = load_tokenizer(str(save_word_tokenizer(tmp_path / "tok", CORPUS, with_pad=False)))
    assert tok.pad_id == tok.eos_id == 1


def test_tokenizer_errors(tmp_path):
    with raises_one_line("neither 'byte' nor an existing local directory"):
        load_tokenizer(str(tmp_path / "absent"))
    (tmp_path / "empty").mkdir()
    with raises_one_line(f"no usable tokenizer in directory '{tmp_path / 'empty'}'"):
        load_tokenizer(str(tmp_path / "empty"))
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text('{"model_type": "gpt2"}', encoding="utf-8")
    with raises_one_line("no tokenizer files"):
        load_tokenizer(str(tmp_path / "model"))


# ---- bad input ----


def load(path, **kwargs):
    return load_data(str(path), BYTE, **{"seq_len": 8, "eval_fraction": 0.0, **kwargs})


def test_missing_file_and_unknown_sources(tmp_path):
    with raises_one_line(f"data file not found: {tmp_path / 'nope.txt'}"):
        load(tmp_path / "nope.txt")
    (tmp_path / "d.csv").write_text("a,b\n", encoding="utf-8")
    with raises_one_line(r"d\.csv: unknown data file extension '\.csv'; expected \.txt or \.jsonl"):
        load(tmp_path / "d.csv")
    with raises_one_line("unknown built-in corpus 'builtin:wiki'"):
        load("builtin:wiki")
    (tmp_path / "sub").mkdir()
    with raises_one_line("holds no .txt or .jsonl files"):
        load(tmp_path / "sub")


def test_jsonl_errors_name_file_line_and_field(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "ok"}\n\n{"text": oops}\n', encoding="utf-8")
    with raises_one_line(r"bad\.jsonl:3: not valid JSON"):
        load(path)
    write_jsonl(path, [{"instruction": "a", "output": "b"}, {"instruction": "c", "input": "d"}])
    with raises_one_line(r"bad\.jsonl:2: record has no 'output' field, expected in instruction data"):
        load(path)
    write_jsonl(path, [{"text": "fine"}, {"text": ["not", "a", "string"]}])
    with raises_one_line(r"bad\.jsonl:2: field 'text' must be a string, got list"):
        load(path)
    write_jsonl(path, [{"text": "fine"}, {"instruction": "a", "output": "b"}])
    with raises_one_line(r"bad\.jsonl:2: record has no 'text' field"):
        load(path)
    write_jsonl(path, [{"prompt": "a"}])
    with raises_one_line(r"bad\.jsonl:1: record has neither a 'text' field"):
        load(path)
    write_jsonl(path, [["a list"]])
    with raises_one_line(r"bad\.jsonl:1: expected a JSON object, got list"):
        load(path)


def test_mixed_directory_is_refused(tmp_path):
    (tmp_path / "a.txt").write_text("text\n", encoding="utf-8")
    write_jsonl(tmp_path / "b.jsonl", [{"instruction": "a", "output": "b"}])
    with raises_one_line("holds instruction data, but .*a.txt holds LM text"):
        load(tmp_path)


def test_empty_data_short_data_and_bad_arguments(tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n  \n", encoding="utf-8")
    with raises_one_line("no documents found"):
        load(empty)
    short = tmp_path / "short.txt"
    short.write_text("abc\n", encoding="utf-8")
    with raises_one_line(r"short\.txt \(train\): 4 tokens in 1 documents, fewer than one full sequence of seq_len=8"):
        load(short)
    with raises_one_line(r"\(eval\): 0 tokens in 0 documents"):
        load(short, split="eval")
    with raises_one_line("seq_len must be at least 2, got 1"):
        load(short, seq_len=1)
    with raises_one_line("split must be one of train, eval"):
        load(short, split="test")
    with raises_one_line(r"eval_fraction must be in \[0, 1\]"):
        load(short, eval_fraction=1.5)
