"""Hugging Face dataset folders as corpora: a `save_to_disk` directory, its `.arrow` files and a local dataset
repository (`data/*.parquet`, `data/*.jsonl`) give the samples of the same records in a .jsonl file."""

import json

import datasets  # the hf extra, which the test extra includes
import pytest
import torch

from tests.helpers.chat_templates import CHATML, save_tokenizer
from pipelines.data.corpus import read_documents
from pipelines.data.in_memory import load_data
from pipelines.data.tokenizers import load_tokenizer
from preinfer.errors import UsageError

CHATS = [{"messages": [{"role": "user", "content": f"question {i}?"},
                       {"role": "assistant", "content": f"answer {i}, at some length " * (1 + i % 3)}]}
         for i in range(30)]
TEXTS = [{"text": f"document {i}: " + "words and more words " * (2 + i % 5)} for i in range(30)]


def layouts(root, records) -> dict[str, str]:
    """The same records as .jsonl, a save_to_disk directory, its .arrow file, a DatasetDict directory and local
    repositories of parquet and jsonl files."""
    root.mkdir()
    jsonl = root / "records.jsonl"
    jsonl.write_text("".join(json.dumps(record) + "\n" for record in records))
    dataset = datasets.Dataset.from_list(records)
    dataset.save_to_disk(root / "saved")
    datasets.DatasetDict({"train": dataset, "test": dataset.select(range(3))}).save_to_disk(root / "dict")
    (root / "repo" / "data").mkdir(parents=True)
    (root / "repo" / "README.md").write_text("---\nlicense: mit\n---\n")
    dataset.to_parquet(root / "repo" / "data" / "train-00000-of-00001.parquet")
    (root / "repo-jsonl" / "data").mkdir(parents=True)
    (root / "repo-jsonl" / "data" / "train.jsonl").write_text(jsonl.read_text())
    arrow = next((root / "saved").glob("*.arrow"))
    return {"saved": str(root / "saved"), "arrow": str(arrow), "dict": str(root / "dict"), "repo": str(root / "repo"),
            "repo-jsonl": str(root / "repo-jsonl"), "jsonl": str(jsonl)}


@pytest.mark.parametrize("records, chat", [(CHATS, True), (TEXTS, False)], ids=["chat", "text"])
def test_dataset_folders_give_the_samples_of_the_same_records_in_jsonl(tmp_path, records, chat):
    tokenizer = load_tokenizer(str(save_tokenizer(tmp_path / "tok", CHATML))) if chat else load_tokenizer("byte")
    specs = layouts(tmp_path / "data", records)
    assert read_documents(specs["arrow"]) == read_documents(specs["jsonl"])
    for split in ("train", "eval"):
        expected = load_data(specs["jsonl"], tokenizer, 160, split, eval_fraction=0.2)[:]
        for name in ("saved", "arrow", "dict", "repo", "repo-jsonl"):
            got = load_data(specs[name], tokenizer, 160, split, eval_fraction=0.2)[:]
            assert all(torch.equal(got[field], expected[field]) for field in expected), (name, split)


def test_a_bad_record_in_an_arrow_file_is_refused_in_one_line_naming_its_row(tmp_path):
    records = [*CHATS[:3], {"messages": [{"role": "robot", "content": "beep"}]}]
    datasets.Dataset.from_list(records).save_to_disk(tmp_path / "saved")
    arrow = next((tmp_path / "saved").glob("*.arrow"))
    with pytest.raises(UsageError) as error:
        read_documents(str(tmp_path / "saved"))
    assert str(error.value).startswith(f"{arrow}: row 4: messages[0]: 'role' must be one of")
    assert "\n" not in str(error.value)


def test_a_dataset_dict_without_a_train_split_is_refused_naming_its_splits(tmp_path):
    dataset = datasets.Dataset.from_list(TEXTS)
    datasets.DatasetDict({"validation": dataset}).save_to_disk(tmp_path / "dict")
    with pytest.raises(UsageError, match=r"without a 'train' split \(it has \['validation'\]\)"):
        read_documents(str(tmp_path / "dict"))
