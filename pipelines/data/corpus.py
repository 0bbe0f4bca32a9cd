"""Corpora: documents read lazily, in a deterministic order, from files, directories, glob patterns, Hugging Face
dataset folders or a built-in corpus, and the fingerprint of a corpus's content.

Sources (`spec`; which files it names: `pipelines.data.corpus_files`):
- `builtin:pydoc`: Python's own `pydoc_data.topics.topics` (ships with CPython); each topic is a document, in key
  order.
- a `.txt` file (or one without an extension): documents are its paragraphs (separated by one or more blank lines;
  a blank line holds only spaces and tabs; "\r\n" and "\r" count as "\n"; a leading byte order mark is dropped).
- a `.jsonl` file (lines split at "\n" only): LM text if the first record has the text field (`text_column`,
  default `text`); chat data if it has `messages` or ShareGPT `conversations` (`pipelines.data.conversations`);
  instruction data if it has `instruction` (optional `input`, required `output`). Every record must then be of the
  same kind.
- a `.parquet` file: the same rule on its columns (pyarrow reads it by row groups; `pip install 'preinfer[parquet]'`).
- an `.arrow` file (Arrow IPC, as Hugging Face `datasets` writes them): the same rule, one record batch at a time.
- a Hugging Face dataset folder: a `save_to_disk` directory (the `.arrow` files its `state.json` names; of a
  `DatasetDict`, one split's), or a local dataset repository laid out as `data/*.parquet` or `data/*.jsonl` (one
  split's files): the split `split` (`--dataset-split`) names, `train` by default.
- `.txt` and `.jsonl` files may be compressed: `.txt.gz`, `.jsonl.zst`, ...
- a directory: every data file under it, in path order; a glob pattern (`data/*.jsonl.gz`, `shards/**/*.parquet`):
  the data files it matches, in path order (directories it matches are read as directories). All files of one
  source hold one kind (LM text or instruction data).

Nothing is read whole: text is decoded and split into paragraphs block by block, JSON lines one line at a time and
Parquet one batch of rows at a time, so memory holds one document (and one read block) at a time. Bad records are
refused with their file and line (or row).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from pathlib import Path

from pipelines.data.corpus_files import DEFAULT_SPLIT, base_directory, check_unsplit, corpus_files, read_as
from pipelines.data.records import Document, InstructionExample, kind_name
from pipelines.data.tables import arrow_documents, parquet_documents
from pipelines.data.text_files import READ_BLOCK, jsonl_documents, text_documents
from preinfer.errors import UsageError, first_line

__all__ = ["BUILTIN_CORPORA", "CorpusDigest", "Document", "InstructionExample", "corpus_fingerprint", "corpus_files",
           "iter_documents", "kind_name", "read_documents"]

BUILTIN_CORPORA = ("builtin:pydoc",)
_FINGERPRINT_VERSION = 1
CorpusDigest = tuple[str, dict[str, str | int]]  # a corpus's fingerprint: (sha256 hex, readable parts)


def iter_documents(spec: str, text_column: str = "text", split: str = DEFAULT_SPLIT) -> Iterator[Document]:
    """The documents of a source, lazily and in a deterministic order: all strings (LM text), all
    `InstructionExample`s or all conversations; the first document fixes the kind, and a file of another kind is
    refused. `split` chooses among a dataset folder's splits."""
    if spec.startswith("builtin:"):
        yield from _builtin_documents(spec, split)
        return
    first: tuple[str, Path] | None = None  # (kind, file) of the first non-empty file
    for file in corpus_files(spec, split):
        documents = _file_documents(file, text_column)
        head = next(documents, None)
        if head is None:
            continue
        kind = kind_name(head)
        if first is None:
            first = (kind, file)
        elif kind != first[0]:
            raise UsageError(f"{file} holds {kind}, but {first[1]} holds {first[0]}; a dataset must not mix them")
        yield head
        yield from documents


def read_documents(spec: str, text_column: str = "text", split: str = DEFAULT_SPLIT) -> list[Document]:
    """Every document of a source, in a list (for small sources; see `iter_documents`)."""
    return list(iter_documents(spec, text_column, split))


def _builtin_documents(spec: str, split: str) -> list[str]:
    if spec not in BUILTIN_CORPORA:
        raise UsageError(f"unknown built-in corpus '{spec}'; built-in corpora are {', '.join(BUILTIN_CORPORA)}")
    check_unsplit(spec, split)
    from pydoc_data.topics import topics

    return [topics[key] for key in sorted(topics)]


def _file_documents(path: Path, text_column: str) -> Iterator[Document]:
    """The documents of one data file, read by its suffix (`read_as`)."""
    suffix = read_as(path)
    if suffix == ".parquet":
        return parquet_documents(path, text_column)
    if suffix == ".arrow":
        return arrow_documents(path, text_column)
    if suffix.startswith(".txt"):
        return text_documents(path)
    return jsonl_documents(path, text_column)


def corpus_fingerprint(spec: str, text_column: str = "text", split: str = DEFAULT_SPLIT) -> CorpusDigest:
    """(sha256 hex, readable parts) of a source's content: each file's name relative to the source and the sha256
    of its bytes, in reading order (a built-in corpus: its documents). Where the corpus lies and the files' times do
    not count, so a copied corpus keeps its fingerprint and an edited one never does."""
    digest = hashlib.sha256(json.dumps({"version": _FINGERPRINT_VERSION, "text_column": text_column}).encode())
    if spec.startswith("builtin:"):
        for document in _builtin_documents(spec, split):
            digest.update(hashlib.sha256(document.encode("utf-8")).digest())
        return digest.hexdigest(), {"corpus": spec}
    files = corpus_files(spec, split)
    base = base_directory(spec)
    total = 0
    for file in files:
        name = file.relative_to(base).as_posix() if file.is_relative_to(base) else file.as_posix()
        size, content = _file_digest(file)
        total += size
        digest.update(json.dumps([name, size, content]).encode())
    return digest.hexdigest(), {"corpus": spec, "files": len(files), "bytes": total}


def _file_digest(path: Path) -> tuple[int, str]:
    """(size, sha256 hex) of a file's bytes, read in blocks."""
    digest = hashlib.sha256()
    size = 0
    try:
        with path.open("rb") as stream:
            while block := stream.read(READ_BLOCK):
                digest.update(block)
                size += len(block)
    except OSError as error:
        raise UsageError(f"{path}: cannot read it ({type(error).__name__}: {first_line(error)})") from None
    return size, digest.hexdigest()
