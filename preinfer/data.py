"""Datasets: text and instruction data, tokenised into fixed-length training samples.

Sources (`spec`):
- `builtin:pydoc`: Python's own `pydoc_data.topics.topics` (ships with CPython); each topic is a document, in key order.
- a `.txt` file: documents are its paragraphs (separated by one or more blank lines), so that it can be split.
- a `.jsonl` file: LM text if the first record has a `text` field; instruction data if it has `instruction`
  (optional `input`, required `output`). Every record must then be of the same kind.
- a directory: every `.txt` and `.jsonl` file under it, in path order; all of one kind (LM text or instruction).

LM text: each document is tokenised and followed by eos, all are concatenated and cut into sequences of `seq_len`
tokens (the short tail is dropped); every position is attended and supervised (labels == input_ids).

Instruction data: tokens = encode(prompt) + encode(output) + [eos] (see `format_prompt`), truncated to `seq_len`
and right-padded with pad; labels are -100 on the prompt and the padding. Examples whose prompt fills all of
`seq_len` are dropped (with a warning).

Train/eval split: by document (by example for instruction data), before packing. A document goes to eval when the
first 8 bytes of the sha256 of its content, read as a fraction of 2**64, are below `eval_fraction`: deterministic,
independent of order, and a document never lands in both splits.
"""

from __future__ import annotations

import hashlib
import json
import logging
import operator
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from preinfer.errors import UsageError
from preinfer.tokenizers import Tokenizer

logger = logging.getLogger(__name__)

SPLITS = ("train", "eval")
IGNORE_INDEX = -100
BUILTIN_CORPORA = ("builtin:pydoc",)
DATA_SUFFIXES = (".txt", ".jsonl")
_PARAGRAPH_BREAK = re.compile(r"\n(?:[ \t]*\n)+")
_FINGERPRINT_VERSION = 1


@dataclass(frozen=True)
class InstructionExample:
    """One instruction record; `input` is "" when the record has none."""

    instruction: str
    input: str
    output: str

    def key(self) -> str:
        """The text whose hash places this example in a split."""
        return json.dumps([self.instruction, self.input, self.output])


Documents = list[str] | list[InstructionExample]


def format_prompt(instruction: str, input_text: str = "") -> str:
    """The prompt template: an Alpaca-style instruction block, the input block only when there is an input."""
    prompt = f"### Instruction:\n{instruction}\n\n"
    if input_text:
        prompt += f"### Input:\n{input_text}\n\n"
    return prompt + "### Response:\n"


@dataclass
class TokenDataset:
    """Fixed-length samples of one split, as three aligned [N, T] tensors."""

    input_ids: torch.Tensor  # int64 [N, T]
    attention_mask: torch.Tensor  # bool [N, T], True on real tokens (right padding)
    labels: torch.Tensor  # int64 [N, T], unshifted; -100 on padding and prompt tokens
    source: str
    split: str

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def __getitem__(self, index: int | slice | torch.Tensor) -> dict[str, torch.Tensor]:
        """The samples at `index` (int, slice, list or index tensor); the batch axis is kept ([1, T] for an int)."""
        if isinstance(index, torch.Tensor) and index.ndim == 0:
            index = int(index)
        if not isinstance(index, (slice, list, torch.Tensor)):
            position = operator.index(index)
            if not -len(self) <= position < len(self):
                raise IndexError(f"sample {position} out of range for {len(self)} samples")
            position %= len(self)
            index = slice(position, position + 1)
        return {
            "input_ids": self.input_ids[index],
            "attention_mask": self.attention_mask[index],
            "labels": self.labels[index],
        }

    @property
    def seq_len(self) -> int:
        return self.input_ids.shape[1]

    def head(self, n: int) -> TokenDataset:
        """The first `n` samples as a dataset of their own (quick experiments, demos)."""
        return TokenDataset(self.input_ids[:n], self.attention_mask[:n], self.labels[:n], self.source, self.split)

    @property
    def num_tokens(self) -> int:
        """Real (unpadded) tokens."""
        return int(self.attention_mask.sum())

    def fingerprint(self) -> str:
        """sha256 hex of the tensors' content, seq_len and split (not of the source's name)."""
        digest = hashlib.sha256()
        header = {"version": _FINGERPRINT_VERSION, "shape": list(self.input_ids.shape), "split": self.split}
        digest.update(json.dumps(header, sort_keys=True).encode())
        digest.update(self.input_ids.cpu().numpy().astype("<i8").tobytes())
        digest.update(self.attention_mask.cpu().numpy().astype(np.uint8).tobytes())
        digest.update(self.labels.cpu().numpy().astype("<i8").tobytes())
        return digest.hexdigest()


def load_data(
    spec: str, tokenizer: Tokenizer, seq_len: int, split: str = "train", eval_fraction: float = 0.1
) -> TokenDataset:
    """The `split` of the data at `spec`, tokenised into samples of `seq_len` tokens (see the module docstring)."""
    _check_arguments(seq_len, split, eval_fraction)
    documents = read_documents(spec)
    if not documents:
        raise UsageError(f"{spec}: no documents found (empty dataset)")
    chosen = [doc for doc in documents if in_eval_split(_split_key(doc), eval_fraction) == (split == "eval")]
    if isinstance(documents[0], InstructionExample):
        tensors = _instruction_samples(chosen, tokenizer, seq_len, f"{spec} ({split})")
    else:
        tensors = _packed_samples(chosen, tokenizer, seq_len, f"{spec} ({split})")
    input_ids, attention_mask, labels = tensors
    return TokenDataset(input_ids, attention_mask, labels, source=spec, split=split)


def _check_arguments(seq_len: int, split: str, eval_fraction: float) -> None:
    if seq_len < 2:
        raise UsageError(f"seq_len must be at least 2, got {seq_len}")
    if split not in SPLITS:
        raise UsageError(f"split must be one of {', '.join(SPLITS)}, got '{split}'")
    if not 0.0 <= eval_fraction <= 1.0:
        raise UsageError(f"eval_fraction must be in [0, 1], got {eval_fraction}")


def in_eval_split(key: str, eval_fraction: float) -> bool:
    """Whether the document with content `key` belongs to the eval split."""
    head = int.from_bytes(hashlib.sha256(key.encode("utf-8")).digest()[:8], "big")
    return head < eval_fraction * 2**64


def _split_key(document: str | InstructionExample) -> str:
    return document.key() if isinstance(document, InstructionExample) else document


# ---- reading sources ----


def read_documents(spec: str) -> Documents:
    """The documents of a source, in a deterministic order: all strings (LM text) or all `InstructionExample`s."""
    if spec.startswith("builtin:"):
        return _builtin_documents(spec)
    path = Path(spec)
    if not path.exists():
        raise UsageError(f"data file not found: {spec}")
    if path.is_dir():
        return _directory_documents(path)
    return _file_documents(path)


def _builtin_documents(spec: str) -> list[str]:
    if spec != "builtin:pydoc":
        raise UsageError(f"unknown built-in corpus '{spec}'; built-in corpora are {', '.join(BUILTIN_CORPORA)}")
    from pydoc_data.topics import topics

    return [topics[key] for key in sorted(topics)]


def _directory_documents(directory: Path) -> Documents:
    files = sorted(path for path in directory.rglob("*") if path.is_file() and path.suffix in DATA_SUFFIXES)
    if not files:
        raise UsageError(f"directory {directory} holds no {' or '.join(DATA_SUFFIXES)} files")
    documents: list = []
    first: tuple[str, Path] | None = None  # (kind, file) of the first non-empty file
    for file in files:
        file_documents = _file_documents(file)
        if not file_documents:
            continue
        kind = _kind_name(file_documents)
        if first is None:
            first = (kind, file)
        elif kind != first[0]:
            raise UsageError(f"{file} holds {kind}, but {first[1]} holds {first[0]}; a directory must not mix them")
        documents.extend(file_documents)
    return documents


def _kind_name(documents: Documents) -> str:
    return "instruction data" if isinstance(documents[0], InstructionExample) else "LM text"


def _file_documents(path: Path) -> Documents:
    if path.suffix == ".txt":
        return _paragraphs(_read_text(path))
    if path.suffix == ".jsonl":
        return _jsonl_documents(path)
    raise UsageError(f"{path}: unknown data file extension '{path.suffix}'; expected .txt or .jsonl (or builtin:pydoc)")


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        raise UsageError(f"{path}: not UTF-8 text (byte {error.start})") from None


def _paragraphs(text: str) -> list[str]:
    """The blank-line-separated paragraphs of `text`, without their surrounding newlines; empty ones dropped."""
    return [part.strip("\n") for part in _PARAGRAPH_BREAK.split(text) if part.strip()]


def _jsonl_records(path: Path) -> Iterator[tuple[int, dict]]:
    """(line number, record) for each non-blank line; every line must be a JSON object."""
    for number, line in enumerate(_read_text(path).splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise UsageError(f"{path}:{number}: not valid JSON ({error.msg} at column {error.colno})") from None
        if not isinstance(record, dict):
            raise UsageError(f"{path}:{number}: expected a JSON object, got {type(record).__name__}")
        yield number, record


def _jsonl_documents(path: Path) -> Documents:
    """LM text or instruction examples, by the fields of the first record; every record must match it."""
    documents: list = []
    is_instruction = None
    for number, record in _jsonl_records(path):
        if is_instruction is None:
            is_instruction = _detect_instruction(path, number, record)
        if is_instruction:
            documents.append(_instruction_record(path, number, record))
        else:
            documents.append(_string_field(path, number, record, "text", "LM text (the first record has 'text')"))
    return documents


def _detect_instruction(path: Path, number: int, record: dict) -> bool:
    if "text" in record:
        return False
    if "instruction" in record or "output" in record:
        return True
    raise UsageError(
        f"{path}:{number}: record has neither a 'text' field (LM text) nor 'instruction'/'output' fields "
        f"(instruction data); its fields are {sorted(record)}"
    )


def _instruction_record(path: Path, number: int, record: dict) -> InstructionExample:
    kind = "instruction data (the first record has 'instruction')"
    instruction = _string_field(path, number, record, "instruction", kind)
    output = _string_field(path, number, record, "output", kind)
    input_text = record.get("input") or ""
    if not isinstance(input_text, str):
        raise UsageError(f"{path}:{number}: field 'input' must be a string, got {type(input_text).__name__}")
    return InstructionExample(instruction, input_text, output)


def _string_field(path: Path, number: int, record: dict, field: str, kind: str) -> str:
    if field not in record:
        raise UsageError(f"{path}:{number}: record has no '{field}' field, expected in {kind}")
    value = record[field]
    if not isinstance(value, str):
        raise UsageError(f"{path}:{number}: field '{field}' must be a string, got {type(value).__name__}")
    return value


# ---- tokenising ----


def _encode(tokenizer: Tokenizer, text: str) -> np.ndarray:
    return np.asarray(tokenizer.encode(text), dtype=np.int64)


def _packed_samples(
    documents: list[str], tokenizer: Tokenizer, seq_len: int, where: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Documents + eos, concatenated and cut into [N, seq_len]; the short tail is dropped."""
    eos = np.array([tokenizer.eos_id], dtype=np.int64)
    pieces = [piece for doc in documents for piece in (_encode(tokenizer, doc), eos)]
    stream = np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int64)
    count = len(stream) // seq_len
    if count == 0:
        raise UsageError(
            f"{where}: {len(stream)} tokens in {len(documents)} documents, fewer than one full sequence of "
            f"seq_len={seq_len}"
        )
    input_ids = torch.from_numpy(stream[: count * seq_len].reshape(count, seq_len).copy())
    return input_ids, torch.ones_like(input_ids, dtype=torch.bool), input_ids.clone()


def _instruction_samples(
    examples: list[InstructionExample], tokenizer: Tokenizer, seq_len: int, where: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Prompt + response + eos per row, truncated and right-padded; labels only on the response."""
    rows = [_instruction_tokens(example, tokenizer, seq_len) for example in examples]
    kept = [row for row in rows if row is not None]
    dropped = len(rows) - len(kept)
    if dropped:
        logger.warning(
            "%s: dropped %d of %d instruction examples whose prompt fills all seq_len=%d tokens (no response left)",
            where, dropped, len(rows), seq_len,
        )
    if not kept:
        raise UsageError(
            f"{where}: no instruction example left ({len(rows)} in this split, {dropped} dropped because the prompt "
            f"fills seq_len={seq_len})"
        )
    input_ids = np.full((len(kept), seq_len), tokenizer.pad_id, dtype=np.int64)
    labels = np.full((len(kept), seq_len), IGNORE_INDEX, dtype=np.int64)
    attention_mask = np.zeros((len(kept), seq_len), dtype=bool)
    for row, (prompt_len, tokens) in enumerate(kept):
        input_ids[row, : len(tokens)] = tokens
        labels[row, prompt_len : len(tokens)] = tokens[prompt_len:]
        attention_mask[row, : len(tokens)] = True
    return torch.from_numpy(input_ids), torch.from_numpy(attention_mask), torch.from_numpy(labels)


def _instruction_tokens(
    example: InstructionExample, tokenizer: Tokenizer, seq_len: int
) -> tuple[int, np.ndarray] | None:
    """(prompt length, tokens truncated to seq_len), or None when no response token fits."""
    prompt = _encode(tokenizer, format_prompt(example.instruction, example.input))
    if len(prompt) >= seq_len:
        return None
    response = np.concatenate([_encode(tokenizer, example.output), [tokenizer.eos_id]])
    return len(prompt), np.concatenate([prompt, response])[:seq_len]
