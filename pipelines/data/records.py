"""Records of a data file (a JSON line, a table row) read as documents: LM text, instruction examples or
conversations, the kind fixed by the fields of a file's first record."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass

from pipelines.data.conversations import Conversation, chat_field, chat_record
from preinfer.errors import UsageError

LM_TEXT, INSTRUCTION_DATA, CHAT_DATA = "LM text", "instruction data", "chat data"


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
Parser = Callable[[str, dict], Document]


def kind_name(document: Document) -> str:
    """The kind of data a document belongs to, in words."""
    if isinstance(document, Conversation):
        return CHAT_DATA
    return INSTRUCTION_DATA if isinstance(document, InstructionExample) else LM_TEXT


def record_parser(where: str, fields: set[str], text_column: str) -> Parser:
    """How to read every record of a file, decided by the fields of its first one."""
    if text_column in fields:
        kind = f"LM text (the first record has '{text_column}')"
        return lambda where_, record: string_field(where_, record, text_column, kind)
    if chat_field(fields) is not None:
        return chat_record
    if "instruction" in fields or "output" in fields:
        return _instruction_record
    raise UsageError(
        f"{where}: record has neither a '{text_column}' field (LM text), nor 'messages' or 'conversations' (chat "
        f"data), nor 'instruction'/'output' fields (instruction data); its fields are {sorted(fields)}"
    )


def record_columns(names: set[str], text_column: str) -> list[str]:
    """The columns of a table that its records are read from (the rule of `record_parser`)."""
    if text_column in names:
        return [text_column]
    chat = chat_field(names)
    return [chat] if chat is not None else sorted(names & {"instruction", "input", "output"})


def _instruction_record(where: str, record: dict) -> InstructionExample:
    kind = "instruction data (the first record has 'instruction')"
    instruction = string_field(where, record, "instruction", kind)
    output = string_field(where, record, "output", kind)
    input_text = record.get("input") or ""
    if not isinstance(input_text, str):
        raise UsageError(f"{where}: field 'input' must be a string, got {type(input_text).__name__}")
    return InstructionExample(instruction, input_text, output)


def string_field(where: str, record: dict, field: str, kind: str) -> str:
    """The string `record[field]`, refused in one line naming `where` when missing or not a string."""
    if field not in record:
        raise UsageError(f"{where}: record has no '{field}' field, expected in {kind}")
    value = record[field]
    if not isinstance(value, str):
        raise UsageError(f"{where}: field '{field}' must be a string, got {type(value).__name__}")
    return value
