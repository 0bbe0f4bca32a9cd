"""Conversations: chat records read from a corpus, as (role, content) turns.

Accepted records (each a JSON object, or a row of a Parquet file or Hugging Face dataset):
- `messages`: a list of {"role", "content"}, roles `system`, `user` and `assistant` (TRL, OpenAI);
- ShareGPT `conversations`: a list of {"from", "value"}, `from` one of `system`, `human` (user) and `gpt`
  (assistant) (also `user` and `assistant`);
- Alpaca `instruction`/`input`/`output` (read as `pipelines.data.corpus.InstructionExample`): with a chat template it
  is the conversation [user: instruction, then a blank line and input when there is one; assistant: output].
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from preinfer.errors import UsageError

ROLES = ("system", "user", "assistant")
SHAREGPT_ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant"}
CHAT_FIELDS = ("messages", "conversations")


@dataclass(frozen=True)
class Conversation:
    """One conversation: its turns as (role, content) pairs, roles among `ROLES`, and where it was read (its file
    and line or row, for messages; not part of its identity)."""

    turns: tuple[tuple[str, str], ...]
    where: str = field(default="", compare=False)

    def key(self) -> str:
        """The text whose hash places this conversation in a split."""
        return json.dumps([list(turn) for turn in self.turns])

    def messages(self) -> list[dict[str, str]]:
        """The turns as chat-template messages."""
        return [{"role": role, "content": content} for role, content in self.turns]

    @property
    def chars(self) -> int:
        return sum(len(content) for _, content in self.turns)


def alpaca_conversation(instruction: str, input_text: str, output: str) -> Conversation:
    """An Alpaca record as a conversation: the user asks the instruction (and its input after a blank line)."""
    question = f"{instruction}\n\n{input_text}" if input_text else instruction
    return Conversation((("user", question), ("assistant", output)))


def chat_field(fields: set[str] | list[str]) -> str | None:
    """The chat field (`messages` or `conversations`) a record with these fields holds, if any."""
    return next((name for name in CHAT_FIELDS if name in fields), None)


def chat_record(where: str, record: dict) -> Conversation:
    """The conversation of a `messages` or ShareGPT `conversations` record, refused in one line when malformed."""
    name = chat_field(set(record))
    if name is None:
        raise UsageError(f"{where}: record has no 'messages' or 'conversations' field, expected in chat data")
    turns = record[name]
    if not isinstance(turns, list) or not turns:
        raise UsageError(f"{where}: field '{name}' must be a non-empty list of turns")
    role_key, content_key = ("role", "content") if name == "messages" else ("from", "value")
    return Conversation(tuple(_turn(f"{where}: {name}[{index}]", turn, role_key, content_key)
                              for index, turn in enumerate(turns)), where)


def _turn(where: str, turn: object, role_key: str, content_key: str) -> tuple[str, str]:
    if not isinstance(turn, dict):
        raise UsageError(f"{where}: expected an object with '{role_key}' and '{content_key}', got "
                         f"{type(turn).__name__}")
    role, content = turn.get(role_key), turn.get(content_key)
    names = ROLES if role_key == "role" else tuple(SHAREGPT_ROLES)
    if role not in names:
        raise UsageError(f"{where}: '{role_key}' must be one of {', '.join(names)}, got {role!r}")
    if not isinstance(content, str):
        raise UsageError(f"{where}: '{content_key}' must be a string, got {type(content).__name__}")
    return (role if role_key == "role" else SHAREGPT_ROLES[role]), content
