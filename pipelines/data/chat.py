"""Conversations rendered by a tokenizer's chat template, with their assistant mask: the tokens the loss covers.

The mask covers every assistant turn's tokens, its end-of-turn token included (`<|im_end|>`, `<|eot_id|>`), and
nothing else: not the system and user turns, not the header that opens an assistant turn, not the separator after
its end-of-turn token. A template that marks assistant turns with `{% generation %}` gets transformers' own mask
(`return_assistant_tokens_mask`). Any other template is rendered turn by turn: assistant turn i spans the
characters from the end of turns [0, i) rendered with the generation prompt to the end of turns [0, i]
rendered, trailing whitespace left out; the tokens overlapping those characters are masked (transformers' rule
for its own spans). Such a template must render each conversation as the prefix of its continuations, and a
conversation's first turn cannot be the assistant's (nothing renders before it).

Rendering goes through transformers' `apply_chat_template` (a sandboxed Jinja environment without a loader):
whatever a template raises there (`raise_exception`, a division by zero, a type error, a range over the sandbox's
limit, `include`/`import`/`extends`, a bound of `pipelines.data.template_bounds` that keeps every render's steps and
sizes bounded) is one `UnrenderableError` naming the record it rendered, as is a conversation
whose assistant turns cannot be found. With `skip_unrenderable` such conversations are left out instead (the caller
counts them: conversations given minus conversations returned).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TypeVar

import numpy as np

from pipelines.data import template_bounds
from pipelines.data.conversations import Conversation
from pipelines.data.tokenizers import Tokenizer
from preinfer.errors import UsageError

# How transformers finds a template that marks its assistant turns (`render_jinja_template`'s own test).
GENERATION_TAG = re.compile(r"\{\%-?\s*generation\s*-?\%\}")
SKIP_HINT = " (--skip-unrenderable skips such conversations and counts them)"
T = TypeVar("T")


@dataclass(frozen=True)
class ChatTokens:
    """One rendered conversation: its ids, its assistant mask and where each assistant turn ends."""

    ids: np.ndarray  # int64 [n]
    mask: np.ndarray  # uint8 [n], 1 on the tokens the loss covers
    ends: tuple[int, ...]  # the token index just past each assistant turn (its end-of-turn token included)

    def fitted(self, seq_len: int) -> int | None:
        """How many leading tokens to keep within `seq_len`: all of them when they fit, else up to the end of the
        last assistant turn that ends within `seq_len`; None (drop it) when no assistant turn does."""
        if len(self.ids) <= seq_len and self.ends:
            return len(self.ids)
        return max((end for end in self.ends if end <= seq_len), default=None)


class UnrenderableError(UsageError):
    """The chat template cannot render a conversation, or its assistant turns cannot be found in what it renders."""


def render_conversations(tokenizer: Tokenizer, conversations: Sequence[Conversation],
                         skip_unrenderable: bool = False) -> list[ChatTokens]:
    """Each conversation rendered by `tokenizer`'s chat template, with its assistant mask (see the module); with
    `skip_unrenderable`, those that raise `UnrenderableError` are left out."""
    if tokenizer.chat_template is None:
        raise UsageError(f"tokenizer {tokenizer.name!r} has no chat template; pass --chat-template FILE")
    template_bounds.install()
    backend, template = tokenizer.backend, tokenizer.chat_template
    if GENERATION_TAG.search(template):
        return list(_renderable(lambda c: _marked(backend, template, c), conversations, skip_unrenderable))
    found = list(_renderable(lambda c: assistant_spans(backend, template, c), conversations, skip_unrenderable))
    if not found:
        return []
    texts, spans = zip(*found)
    encoded = _offsets(backend, list(texts))
    return [_masked(ids, offsets, turn_spans) for (ids, offsets), turn_spans in zip(encoded, spans)]


def _renderable(render: Callable[[Conversation], T], conversations: Sequence[Conversation], skip: bool
                ) -> Iterator[T]:
    """`render` of each conversation; with `skip`, those it refuses as unrenderable are left out."""
    for conversation in conversations:
        try:
            yield render(conversation)
        except UnrenderableError:
            if not skip:
                raise


def _where(conversation: Conversation) -> str:
    return conversation.where or "a conversation"


def _refused(conversation: Conversation, error: Exception) -> UnrenderableError:
    """The one line about a conversation the chat template fails on, naming its record."""
    where = _where(conversation)
    detail = str(error).strip().splitlines()[0] if str(error).strip() else "no details"
    return UnrenderableError(f"{where}: the chat template cannot render this conversation ({type(error).__name__}: "
                             f"{detail[:300]}){SKIP_HINT}")


def _render(backend, template: str, conversation: Conversation, turns: int | None = None,
            generation_prompt: bool = False) -> str:
    """The template's text of the conversation's first `turns` messages (all: None); whatever the template
    raises is refused in one line naming the record."""
    messages = conversation.messages()[:turns]
    try:
        return backend.apply_chat_template(messages, chat_template=template, tokenize=False,
                                           add_generation_prompt=generation_prompt)
    except Exception as error:  # a template may raise anything: its own errors, Python's, the sandbox's
        raise _refused(conversation, error) from None


def assistant_spans(backend, template: str, conversation: Conversation) -> tuple[str, list[tuple[int, int]]]:
    """(the rendered conversation, the character span [start, end) of each assistant turn), found turn by turn."""
    messages = conversation.messages()
    if messages[0]["role"] == "assistant":
        raise UnrenderableError(f"{_where(conversation)}: the conversation starts with the assistant's turn, so "
                                f"nothing renders before it to find where it begins; start it with a system or user "
                                f"turn, or mark the template's assistant turns with {{% generation %}}{SKIP_HINT}")
    text = _render(backend, template, conversation)
    spans = []
    for index, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = _render(backend, template, conversation, index, generation_prompt=True)
        through = _render(backend, template, conversation, index + 1)
        if not (through.startswith(before) and text.startswith(through)):
            raise UnrenderableError(
                f"{_where(conversation)}: the chat template does not render this conversation as "
                f"the beginning of its continuations, so its assistant turns cannot be found; mark them with "
                f"{{% generation %}} ... {{% endgeneration %}} (--chat-template FILE){SKIP_HINT}"
            )
        end = len(through.rstrip())
        if end > len(before):
            spans.append((len(before), end))
    return text, spans


def _offsets(backend, texts: list[str]) -> list[tuple[list[int], list[tuple[int, int]]]]:
    """(ids, character offsets) of each text, special tokens only where the text holds them."""
    try:
        batch = backend(texts, add_special_tokens=False, return_offsets_mapping=True, verbose=False)
    except NotImplementedError:
        raise UsageError("chat data needs a fast tokenizer (one with tokenizer.json) to find assistant tokens"
                         ) from None
    return list(zip(batch["input_ids"], batch["offset_mapping"]))


def _masked(ids: list[int], offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> ChatTokens:
    """The tokens overlapping each span masked (transformers' rule for `return_assistant_tokens_mask`)."""
    mask = np.zeros(len(ids), dtype=np.uint8)
    ends = []
    for start, end in spans:
        hit = [token for token, (first, last) in enumerate(offsets) if first < end and last > start]
        if hit:
            mask[hit[0] : hit[-1] + 1] = 1
            ends.append(hit[-1] + 1)
    return ChatTokens(np.asarray(ids, dtype=np.int64), mask, tuple(ends))


def _marked(backend, template: str, conversation: Conversation) -> ChatTokens:
    """A conversation whose template marks the assistant turns: transformers' own mask."""
    try:
        out = backend.apply_chat_template(conversation.messages(), chat_template=template, tokenize=True,
                                          return_dict=True, return_assistant_tokens_mask=True)
    except Exception as error:  # as `_render`
        raise _refused(conversation, error) from None
    mask = np.asarray(out["assistant_masks"], dtype=np.uint8)
    ends = tuple(int(i) + 1 for i in np.flatnonzero(np.diff(np.append(mask, 0).astype(np.int8)) == -1))
    return ChatTokens(np.asarray(out["input_ids"], dtype=np.int64), mask, ends)
