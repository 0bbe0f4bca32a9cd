"""Text files as corpora: plain text split into paragraphs, and JSON lines, read block by block (or line by line)
from plain, gzip or zstd files, so memory holds one document (and one read block) at a time. A UTF-8 byte order
mark at the start of a file is not text; a bad byte is named by its offset in the file, a bad record by its line."""

from __future__ import annotations

import codecs
import gzip
import io
import json
import re
import zlib
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO

from pipelines.data.records import Document, Parser, record_parser
from preinfer.errors import UsageError, first_line

READ_BLOCK = 1 << 20  # bytes read (and decoded) at a time from a text file
BOM = "\ufeff"
_PARAGRAPH_BREAK = re.compile(r"\n(?:[ \t]*\n)+")


@contextmanager
def binary(path: Path) -> Iterator[BinaryIO]:
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


def text_documents(path: Path) -> Iterator[str]:
    """The paragraphs of a text file, decoded and split one block at a time."""
    return _paragraphs(_decoded_blocks(path))


def _decoded_blocks(path: Path) -> Iterator[str]:
    """The text of `path` in blocks of about READ_BLOCK bytes, with universal newlines ("\r\n" and "\r" read as
    "\n", as text-mode `open` reads them) and without a leading byte order mark; a bad byte is named by its offset
    in the file."""
    utf8 = codecs.getincrementaldecoder("utf-8")()
    decoder = io.IncrementalNewlineDecoder(utf8, translate=True)
    offset = 0  # bytes of the file passed to the decoder so far
    first = True
    with binary(path) as stream:
        while True:
            block = stream.read(READ_BLOCK)
            pending = len(utf8.getstate()[0])
            try:
                text = decoder.decode(block, final=not block)
            except UnicodeDecodeError as error:
                raise _not_utf8(path, offset - pending + error.start) from None
            offset += len(block)
            if text and first:
                text, first = text.removeprefix(BOM), False
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
    """(line number, line) of a text file, split at "\n" only (a "\r" before it dropped), as JSON Lines are:
    U+2028, U+0085 and the like are characters of a line, valid inside a JSON string. Read one line at a time."""
    offset = 0
    with binary(path) as stream:
        for number, raw in enumerate(stream, start=1):
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as error:
                raise _not_utf8(path, offset + error.start) from None
            offset += len(raw)
            yield number, (text.removeprefix(BOM) if number == 1 else text).removesuffix("\n").removesuffix("\r")


def jsonl_documents(path: Path, text_column: str) -> Iterator[Document]:
    """LM text, chat or instruction records, by the fields of the first record; every record must match it."""
    parse: Parser | None = None
    for number, line in _lines(path):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise UsageError(f"{where}: not valid JSON ({error.msg} at column {error.colno})") from None
        except (ValueError, RecursionError) as error:  # an integer of too many digits, nesting too deep
            raise UsageError(f"{where}: not valid JSON ({first_line(error)})") from None
        if not isinstance(record, dict):
            raise UsageError(f"{where}: expected a JSON object, got {type(record).__name__}")
        if parse is None:
            parse = record_parser(where, set(record), text_column)
        yield parse(where, record)
