"""Corpora: documents read lazily, in a deterministic order, from files, directories, glob patterns or a built-in
corpus, and the fingerprint of a corpus's content.

Sources (`spec`):
- `builtin:pydoc`: Python's own `pydoc_data.topics.topics` (ships with CPython); each topic is a document, in key
  order.
- a `.txt` file: documents are its paragraphs (separated by one or more blank lines; a blank line holds only spaces
  and tabs; "\r\n" and "\r" count as "\n"), so that it can be split.
- a `.jsonl` file: LM text if the first record has the text field (`text_column`, default `text`); chat data if it
  has `messages` or ShareGPT `conversations` (`pipelines.data.conversations`); instruction data if it has
  `instruction` (optional `input`, required `output`). Every record must then be of the same kind.
- a `.parquet` file: the same rule on its columns (pyarrow reads it by row groups; `pip install 'preinfer[parquet]'`).
- an `.arrow` file (Arrow IPC, as Hugging Face `datasets` writes them): the same rule, one record batch at a time.
- a Hugging Face dataset folder: a `save_to_disk` directory (its `.arrow` files; of a `DatasetDict`, the `train`
  split's), or a local dataset repository laid out as `data/*.parquet` or `data/*.jsonl` (every data file under it,
  all its splits; a glob such as `repo/data/train-*` takes one).
- `.txt` and `.jsonl` files may be compressed: `.txt.gz`, `.jsonl.zst`, ...
- a directory: every data file under it, in path order; a glob pattern (`data/*.jsonl.gz`, `shards/**/*.parquet`):
  the data files it matches, in path order (directories it matches are read as directories). All files of one
  source hold one kind (LM text or instruction data).

Nothing is read whole: text is decoded and split into paragraphs block by block, JSON lines one line at a time and
Parquet one batch of rows at a time, so memory holds one document (and one read block) at a time. Bad records are
refused with their file and line (or row).
"""

from __future__ import annotations

import codecs
import glob
import gzip
import hashlib
import io
import json
import re
import zlib
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from pipelines.data.conversations import Conversation, chat_field, chat_record
from preinfer.errors import UsageError, first_line

BUILTIN_CORPORA = ("builtin:pydoc",)
COMPRESSIONS = ("", ".gz", ".zst")
DATA_SUFFIXES = tuple(f"{kind}{compression}" for kind in (".txt", ".jsonl") for compression in COMPRESSIONS) + (
    ".parquet", ".arrow",
)
SUFFIXES_IN_WORDS = ".txt or .jsonl files (plain, .gz or .zst), .parquet or .arrow files"
DATASET_DICT = "dataset_dict.json"  # what `DatasetDict.save_to_disk` writes beside its splits' directories
HF_EXTRA = "pip install 'preinfer[hf]'"
LM_TEXT, INSTRUCTION_DATA, CHAT_DATA = "LM text", "instruction data", "chat data"
PARQUET_EXTRA = "pip install 'preinfer[parquet]'"
READ_BLOCK = 1 << 20  # bytes read (and decoded) at a time from a text file
PARQUET_BATCH = 1024  # rows converted to Python at a time
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


Document = str | InstructionExample | Conversation


def kind_name(document: Document) -> str:
    """The kind of data a document belongs to, in words."""
    if isinstance(document, Conversation):
        return CHAT_DATA
    return INSTRUCTION_DATA if isinstance(document, InstructionExample) else LM_TEXT


# ---- which files ----


def data_suffix(path: Path) -> str | None:
    """The data suffix `path`'s name ends with (`.jsonl.gz`, `.parquet`, ...), or None."""
    return next((suffix for suffix in DATA_SUFFIXES if path.name.endswith(suffix)), None)


def corpus_files(spec: str) -> list[Path]:
    """The data files of a file, directory or glob `spec`, in reading order (not for built-in corpora)."""
    path = Path(spec)
    if (path / DATASET_DICT).is_file():
        return corpus_files(str(_train_split(path)))
    if path.is_dir():
        files = _data_files(path.rglob("*"))
        if not files:
            raise UsageError(f"directory {path} holds no {SUFFIXES_IN_WORDS}")
        return files
    if path.exists():
        if data_suffix(path) is None:
            raise UsageError(
                f"{path}: unknown data file extension '{path.suffix}'; expected .txt or .jsonl (plain, .gz or .zst), "
                f".parquet, a directory or a glob pattern of them (or builtin:pydoc)"
            )
        return [path]
    if not glob.has_magic(spec):
        raise UsageError(f"data file not found: {spec}")
    matches = [Path(match) for match in glob.glob(spec, recursive=True)]
    if not matches:
        raise UsageError(f"no file matches the pattern '{spec}'")
    expanded = [file for match in matches for file in ([match] if match.is_file() else match.rglob("*"))]
    files = _data_files(expanded)
    if not files:
        raise UsageError(f"the pattern '{spec}' matches no {SUFFIXES_IN_WORDS}")
    return files


def _train_split(path: Path) -> Path:
    """The `train` split's directory of a saved `DatasetDict`."""
    try:
        splits = json.loads((path / DATASET_DICT).read_text(encoding="utf-8"))["splits"]
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError):
        raise UsageError(f"{path / DATASET_DICT}: not a readable DatasetDict description (no 'splits' list)") from None
    if "train" not in splits or not (path / "train").is_dir():
        raise UsageError(f"{path} is a DatasetDict without a 'train' split (it has {splits}); pass --data "
                         f"{path}/SPLIT to read one of them")
    return path / "train"


def _data_files(paths: Iterable[Path]) -> list[Path]:
    return sorted({path for path in paths if path.is_file() and data_suffix(path) is not None})


def _base_directory(spec: str) -> Path:
    """The directory names of file `spec` are taken relative to: itself (a directory), the pattern's fixed part
    (a glob), or the file's directory."""
    path = Path(spec)
    if path.is_dir():
        return path
    if path.exists():
        return path.parent
    fixed = path.parts[: next(i for i, part in enumerate(path.parts) if glob.has_magic(part))]
    return Path(*fixed) if fixed else Path(".")


# ---- documents ----


def iter_documents(spec: str, text_column: str = "text") -> Iterator[Document]:
    """The documents of a source, lazily and in a deterministic order: all strings (LM text) or all
    `InstructionExample`s; the first document fixes the kind, and a file of the other kind is refused."""
    if spec.startswith("builtin:"):
        yield from _builtin_documents(spec)
        return
    first: tuple[str, Path] | None = None  # (kind, file) of the first non-empty file
    for file in corpus_files(spec):
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


def read_documents(spec: str, text_column: str = "text") -> list[Document]:
    """Every document of a source, in a list (for small sources; see `iter_documents`)."""
    return list(iter_documents(spec, text_column))


def _builtin_documents(spec: str) -> list[str]:
    if spec not in BUILTIN_CORPORA:
        raise UsageError(f"unknown built-in corpus '{spec}'; built-in corpora are {', '.join(BUILTIN_CORPORA)}")
    from pydoc_data.topics import topics

    return [topics[key] for key in sorted(topics)]


def _file_documents(path: Path, text_column: str) -> Iterator[Document]:
    """The documents of one data file (its suffix is one of DATA_SUFFIXES)."""
    suffix = data_suffix(path) or ""
    if suffix == ".parquet":
        return _parquet_documents(path, text_column)
    if suffix == ".arrow":
        return _arrow_documents(path, text_column)
    if suffix.startswith(".txt"):
        return _text_documents(path)
    return _jsonl_documents(path, text_column)


@contextmanager
def _binary(path: Path) -> Iterator[BinaryIO]:
    """`path` opened for reading bytes, decompressed by its suffix; read errors become one-line UsageErrors."""
    import zstandard

    try:
        with path.open("rb") as raw:
            if path.name.endswith(".gz"):
                stream: BinaryIO = gzip.GzipFile(fileobj=raw)
            elif path.name.endswith(".zst"):
                stream = io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(raw), READ_BLOCK)
            else:
                stream = raw
            yield stream
    except (OSError, EOFError, zlib.error, zstandard.ZstdError) as error:
        raise UsageError(f"{path}: cannot read it ({type(error).__name__}: {first_line(error)})") from None


def _not_utf8(path: Path, offset: int) -> UsageError:
    return UsageError(f"{path}: not UTF-8 text (byte {offset})")


def _text_documents(path: Path) -> Iterator[str]:
    """The paragraphs of a text file, decoded and split one block at a time."""
    return _paragraphs(_decoded_blocks(path))


def _decoded_blocks(path: Path) -> Iterator[str]:
    """The text of `path` in blocks of about READ_BLOCK bytes, with universal newlines ("\r\n" and "\r" read as
    "\n", as text-mode `open` reads them); a bad byte is named by its offset in the file."""
    utf8 = codecs.getincrementaldecoder("utf-8")()
    decoder = io.IncrementalNewlineDecoder(utf8, translate=True)
    offset = 0  # bytes of the file passed to the decoder so far
    with _binary(path) as stream:
        while True:
            block = stream.read(READ_BLOCK)
            pending = len(utf8.getstate()[0])
            try:
                text = decoder.decode(block, final=not block)
            except UnicodeDecodeError as error:
                raise _not_utf8(path, offset - pending + error.start) from None
            offset += len(block)
            if text:
                yield text
            if not block:
                return


def _paragraphs(blocks: Iterable[str]) -> Iterator[str]:
    """The paragraphs of the concatenated `blocks`, exactly as splitting the whole text at `_PARAGRAPH_BREAK` would
    give them (surrounding newlines stripped, blank ones dropped), holding one paragraph in memory at a time.

    A break lies inside a run of spaces, tabs and newlines, and a run holds at most one. So the text after the
    last complete break is kept as `pending` pieces plus `edge`, the run it ends with, which is scanned again
    together with the next block.
    """
    pending: list[str] = []
    edge = ""
    for block in blocks:
        buffer = edge + block
        start = 0
        last = None
        for match in _PARAGRAPH_BREAK.finditer(buffer):
            yield from _kept("".join(pending) + buffer[start : match.start()])
            pending, start, last = [], match.end(), match
        if last is not None and not buffer[start:].strip(" \t"):  # the run may go on in the next block
            edge = buffer[last.start() :]
            continue
        rest = buffer[start:]
        body = rest.rstrip("\n \t")
        pending.append(body)
        edge = rest[len(body) :]
    yield from _kept("".join(pending) + edge)


def _kept(part: str) -> list[str]:
    return [part.strip("\n")] if part.strip() else []


def _lines(path: Path) -> Iterator[tuple[int, str]]:
    """(line number, line) of a text file, lines split as `str.splitlines` splits them, read one at a time."""
    number = 0
    offset = 0
    with _binary(path) as stream:
        for raw in stream:
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as error:
                raise _not_utf8(path, offset + error.start) from None
            offset += len(raw)
            for line in text.splitlines():
                number += 1
                yield number, line


def _jsonl_documents(path: Path, text_column: str) -> Iterator[Document]:
    """LM text or instruction examples, by the fields of the first record; every record must match it."""
    parse: Callable[[str, dict], Document] | None = None
    for number, line in _lines(path):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise UsageError(f"{where}: not valid JSON ({error.msg} at column {error.colno})") from None
        if not isinstance(record, dict):
            raise UsageError(f"{where}: expected a JSON object, got {type(record).__name__}")
        if parse is None:
            parse = _record_parser(where, set(record), text_column)
        yield parse(where, record)


def _record_parser(where: str, fields: set[str], text_column: str) -> Callable[[str, dict], Document]:
    """How to read every record of a file, decided by the fields of its first one."""
    if text_column in fields:
        kind = f"LM text (the first record has '{text_column}')"
        return lambda where_, record: _string_field(where_, record, text_column, kind)
    if chat_field(fields) is not None:
        return chat_record
    if "instruction" in fields or "output" in fields:
        return _instruction_record
    raise UsageError(
        f"{where}: record has neither a '{text_column}' field (LM text), nor 'messages' or 'conversations' (chat "
        f"data), nor 'instruction'/'output' fields (instruction data); its fields are {sorted(fields)}"
    )


def record_columns(names: set[str], text_column: str) -> list[str]:
    """The columns of a table that its records are read from (the rule of `_record_parser`)."""
    if text_column in names:
        return [text_column]
    chat = chat_field(names)
    return [chat] if chat is not None else sorted(names & {"instruction", "input", "output"})


def _instruction_record(where: str, record: dict) -> InstructionExample:
    kind = "instruction data (the first record has 'instruction')"
    instruction = _string_field(where, record, "instruction", kind)
    output = _string_field(where, record, "output", kind)
    input_text = record.get("input") or ""
    if not isinstance(input_text, str):
        raise UsageError(f"{where}: field 'input' must be a string, got {type(input_text).__name__}")
    return InstructionExample(instruction, input_text, output)


def _string_field(where: str, record: dict, field: str, kind: str) -> str:
    if field not in record:
        raise UsageError(f"{where}: record has no '{field}' field, expected in {kind}")
    value = record[field]
    if not isinstance(value, str):
        raise UsageError(f"{where}: field '{field}' must be a string, got {type(value).__name__}")
    return value


def _parquet_file(path: Path):
    try:
        import pyarrow.parquet
    except ImportError:
        raise UsageError(f"{path}: reading Parquet needs pyarrow, which is not installed: {PARQUET_EXTRA}") from None
    try:
        return pyarrow.parquet.ParquetFile(path)
    except (OSError, ValueError) as error:  # pyarrow's ArrowInvalid is a ValueError
        raise UsageError(f"{path}: not a readable Parquet file ({first_line(error)})") from None


def _parquet_documents(path: Path, text_column: str) -> Iterator[Document]:
    """LM text or instruction examples from a Parquet file's columns, one batch of rows at a time."""
    parquet = _parquet_file(path)
    names = set(parquet.schema_arrow.names)
    if parquet.metadata.num_rows == 0:
        return
    parse = _record_parser(f"{path}: row 1", names, text_column)
    wanted = record_columns(names, text_column)
    number = 0
    try:
        for batch in parquet.iter_batches(batch_size=PARQUET_BATCH, columns=wanted):
            for record in batch.to_pylist():
                number += 1
                yield parse(f"{path}: row {number}", record)
    except (OSError, ValueError) as error:
        raise UsageError(f"{path}: cannot read the rows after row {number} ({first_line(error)})") from None


def _arrow_batches(path: Path) -> tuple[list[str], Iterator]:
    """(column names, record batches) of an Arrow IPC file (the stream format `datasets` writes, or the file
    format), read one batch at a time."""
    try:
        import pyarrow.ipc
    except ImportError:
        raise UsageError(f"{path}: reading .arrow files needs pyarrow, which is not installed: {HF_EXTRA}") from None
    try:
        stream = pyarrow.ipc.open_stream(path)
        return stream.schema.names, iter(stream)
    except (OSError, ValueError):
        pass
    try:
        file = pyarrow.ipc.open_file(path)
    except (OSError, ValueError) as error:
        raise UsageError(f"{path}: not a readable Arrow IPC file ({first_line(error)})") from None
    return file.schema.names, (file.get_batch(index) for index in range(file.num_record_batches))


def _arrow_documents(path: Path, text_column: str) -> Iterator[Document]:
    """LM text, chat or instruction records from an Arrow file's columns, one record batch at a time."""
    names, batches = _arrow_batches(path)
    columns = record_columns(set(names), text_column) or names
    parse, number = None, 0
    try:
        for batch in batches:
            for record in batch.select(columns).to_pylist():
                number += 1
                parse = parse or _record_parser(f"{path}: row {number}", set(names), text_column)
                yield parse(f"{path}: row {number}", record)
    except (OSError, ValueError) as error:
        raise UsageError(f"{path}: cannot read the rows after row {number} ({first_line(error)})") from None


# ---- fingerprint ----


def corpus_fingerprint(spec: str, text_column: str = "text") -> tuple[str, dict[str, str | int]]:
    """(sha256 hex, readable parts) of a source's content: each file's name relative to the source and the sha256
    of its bytes, in reading order (a built-in corpus: its documents). Where the corpus lies and the files' times do
    not count, so a copied corpus keeps its fingerprint and an edited one never does."""
    digest = hashlib.sha256(json.dumps({"version": _FINGERPRINT_VERSION, "text_column": text_column}).encode())
    if spec.startswith("builtin:"):
        for document in _builtin_documents(spec):
            digest.update(hashlib.sha256(document.encode("utf-8")).digest())
        return digest.hexdigest(), {"corpus": spec}
    files = corpus_files(spec)
    base = _base_directory(spec)
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
