"""Tables as corpora: Parquet files (one batch of rows at a time) and Arrow IPC files (as Hugging Face `datasets`
writes them; one record batch at a time), their rows read as the records of a .jsonl file are
(`pipelines.data.records`)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from pipelines.data.records import Document, record_columns, record_parser
from preinfer.errors import UsageError, first_line

HF_EXTRA = "pip install 'preinfer[hf]'"
PARQUET_EXTRA = "pip install 'preinfer[parquet]'"
PARQUET_BATCH = 1024  # rows converted to Python at a time


def _parquet_file(path: Path):
    try:
        import pyarrow.parquet
    except ImportError:
        raise UsageError(f"{path}: reading Parquet needs pyarrow, which is not installed: {PARQUET_EXTRA}") from None
    try:
        return pyarrow.parquet.ParquetFile(path)
    except (OSError, ValueError) as error:  # pyarrow's ArrowInvalid is a ValueError
        raise UsageError(f"{path}: not a readable Parquet file ({first_line(error)})") from None


def parquet_documents(path: Path, text_column: str) -> Iterator[Document]:
    """LM text, chat or instruction records from a Parquet file's columns, one batch of rows at a time."""
    parquet = _parquet_file(path)
    names = set(parquet.schema_arrow.names)
    if parquet.metadata.num_rows == 0:
        return
    parse = record_parser(f"{path}: row 1", names, text_column)
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


def arrow_documents(path: Path, text_column: str) -> Iterator[Document]:
    """LM text, chat or instruction records from an Arrow file's columns, one record batch at a time."""
    names, batches = _arrow_batches(path)
    columns = record_columns(set(names), text_column) or names
    parse, number = None, 0
    try:
        for batch in batches:
            for record in batch.select(columns).to_pylist():
                number += 1
                parse = parse or record_parser(f"{path}: row {number}", set(names), text_column)
                yield parse(f"{path}: row {number}", record)
    except (OSError, ValueError) as error:
        raise UsageError(f"{path}: cannot read the rows after row {number} ({first_line(error)})") from None
