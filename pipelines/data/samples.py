"""Samples: a corpus's documents tokenised into fixed-length training samples, chunk by chunk (`encode_chunk`) and
cut into blocks (`SamplePacker`), which the token store is built from. Where documents come from:
`pipelines.data.corpus`; the samples of a small input read directly, without a token store:
`pipelines.data.in_memory`.

LM text: each document is tokenised, preceded by the tokenizer's BOS where it adds one and followed by eos; all are
concatenated and cut into sequences of `seq_len` tokens (the short tail is dropped); every position is attended and
supervised (labels == input_ids).

Chat data (`messages`, ShareGPT `conversations`, and Alpaca records when the tokenizer has a chat template): each
conversation is rendered by the chat template (`pipelines.data.chat`) into one right-padded sample of `seq_len`
tokens (never packed); labels are the ids on the assistant mask and -100 elsewhere. A conversation longer than
`seq_len` is cut right after its last assistant turn that ends within `seq_len` (a turn boundary, never inside a
turn); one whose first assistant turn does not end within `seq_len`, or that has no assistant turn, is dropped. Both
are counted (`SplitInfo.truncated`, documents - samples - skipped) and reported. A conversation the chat template
cannot render is refused in one line naming its record, or, with `skip_unrenderable`, skipped and counted
(`SplitInfo.skipped`).

Instruction data without a chat template (the byte tokenizer): tokens = BOS + encode(prompt) + encode(output) +
[eos] (see `format_prompt`), truncated to `seq_len` and right-padded with pad; labels are -100 on the prompt and the
padding. Examples whose prompt fills all of `seq_len` are dropped (with a warning). A conversation of one user turn
and one assistant turn is read as such an example; any other is refused (it needs a chat template).

Train/eval split: by document (by example for instruction data), before packing. A document goes to eval when the
first 8 bytes of the sha256 of its content, read as a fraction of 2**64, are below `eval_fraction`: deterministic,
independent of order, and a document never lands in both splits.

Compact form (`SampleBlock`, `EncodedSplit`) and the packer that cuts encoded chunks into samples
(`SamplePacker`): `pipelines.data.sample_blocks`.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator, Sequence

import numpy as np

from pipelines.data.chat import render_conversations
from pipelines.data.conversations import Conversation, alpaca_conversation
from pipelines.data.corpus import Document, InstructionExample
from pipelines.data.sample_blocks import CHAT, INSTRUCTION, LM, EncodedSplit
from preinfer.errors import UsageError
from pipelines.data.tokenizers import Tokenizer

SPLITS = ("train", "eval")
CHUNK_CHARS = 1 << 22  # characters of documents tokenised together (the unit of work of streaming and of workers)


def format_prompt(instruction: str, input_text: str = "") -> str:
    """The prompt template: an Alpaca-style instruction block, the input block only when there is an input."""
    prompt = f"### Instruction:\n{instruction}\n\n"
    if input_text:
        prompt += f"### Input:\n{input_text}\n\n"
    return prompt + "### Response:\n"


def check_arguments(seq_len: int, split: str, eval_fraction: float) -> None:
    """Refuse a seq_len, split or eval_fraction that no dataset can have."""
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


def _split_key(document: Document) -> str:
    return document if isinstance(document, str) else document.key()


def sample_kind(document: Document, tokenizer: Tokenizer) -> str:
    """The kind of samples `document` makes with `tokenizer`: LM text, chat (a record with turns or instructions
    and a tokenizer with a chat template) or instruction data (the fixed prompt format)."""
    if isinstance(document, str):
        return LM
    return CHAT if tokenizer.chat_template is not None else INSTRUCTION


def as_kind(document: Document, kind: str) -> Document:
    """`document` in the form samples of `kind` are made from: Alpaca records as conversations for chat; a
    conversation of one user and one assistant turn as an instruction example for the fixed prompt format."""
    if kind == CHAT and isinstance(document, InstructionExample):
        return alpaca_conversation(document.instruction, document.input, document.output)
    if kind == INSTRUCTION and isinstance(document, Conversation):
        roles = [role for role, _ in document.turns]
        if roles != ["user", "assistant"]:
            raise UsageError(
                f"a conversation with turns {roles} needs a chat template, and the tokenizer has none (the byte "
                f"tokenizer's fixed prompt format holds one user and one assistant turn); pass --tokenizer DIR of a "
                f"tokenizer with a chat template"
            )
        return InstructionExample(document.turns[0][1], "", document.turns[1][1])
    return document


def _chars(document: Document) -> int:
    if isinstance(document, InstructionExample):
        return len(document.instruction) + len(document.input) + len(document.output)
    if isinstance(document, Conversation):
        return document.chars
    return len(document)


def document_chunks(documents: Iterable[Document], chunk_chars: int = CHUNK_CHARS) -> Iterator[list[Document]]:
    """Consecutive documents grouped into lists of about `chunk_chars` characters (the same lists on every run)."""
    chunk: list[Document] = []
    size = 0
    for document in documents:
        chunk.append(document)
        size += _chars(document)
        if size >= chunk_chars:
            yield chunk
            chunk, size = [], 0
    if chunk:
        yield chunk


# ---- encoding ----


def id_dtype(vocab_size: int) -> np.dtype:
    """The smallest integer dtype that holds every id below `vocab_size` (uint8, uint16, else int32)."""
    for dtype in (np.uint8, np.uint16):
        if vocab_size <= np.iinfo(dtype).max + 1:
            return np.dtype(dtype)
    return np.dtype(np.int32)


def encode_chunk(
    documents: Sequence[Document], tokenizer: Tokenizer, seq_len: int, eval_fraction: float,
    splits: Sequence[str] = SPLITS, skip_unrenderable: bool = False,
) -> dict[str, EncodedSplit]:
    """The documents of each of `splits`, tokenised, in the dtype `id_dtype(tokenizer.vocab_size)`; with
    `skip_unrenderable`, conversations the chat template cannot render are left out (counted)."""
    dtype = id_dtype(tokenizer.vocab_size)
    kind = sample_kind(documents[0], tokenizer) if documents else LM
    chosen: dict[str, list] = {split: [] for split in splits}
    for document in (as_kind(document, kind) for document in documents):
        split = "eval" if in_eval_split(_split_key(document), eval_fraction) else "train"
        if split in chosen:
            chosen[split].append(document)
    encoded = {}
    for split, members in chosen.items():
        if kind == CHAT:
            encoded[split] = _chat_rows(members, tokenizer, seq_len, dtype, skip_unrenderable)
        elif kind == INSTRUCTION:
            encoded[split] = EncodedSplit(*_instruction_rows(members, tokenizer, seq_len, dtype), len(members))
        else:
            encoded[split] = EncodedSplit(_packed_stream(members, tokenizer, dtype), None, len(members))
    return encoded


def _packed_stream(documents: list[str], tokenizer: Tokenizer, dtype: np.dtype) -> np.ndarray:
    """The documents' ids, each preceded by BOS (where the tokenizer adds one) and followed by eos, as one stream."""
    eos = np.array([tokenizer.eos_id], dtype=dtype)
    bos = np.array(tokenizer.bos_ids, dtype=dtype)
    pieces = [piece for ids in tokenizer.encode_batch(documents) for piece in (bos, ids, eos)]
    return np.concatenate(pieces).astype(dtype, copy=False) if pieces else np.zeros(0, dtype)


def _instruction_rows(
    examples: list[InstructionExample], tokenizer: Tokenizer, seq_len: int, dtype: np.dtype
) -> tuple[np.ndarray, np.ndarray]:
    """BOS + prompt + response + eos per row, truncated to seq_len and right-padded; rows whose prompt fills seq_len
    are left out. Returns (ids [kept, seq_len], (prompt length, length) [kept, 2])."""
    bos = np.array(tokenizer.bos_ids, dtype=np.int64)
    prompts = [np.concatenate([bos, prompt]) for prompt in
               tokenizer.encode_batch([format_prompt(example.instruction, example.input) for example in examples])]
    outputs = tokenizer.encode_batch([example.output for example in examples])
    kept = [(prompt, output) for prompt, output in zip(prompts, outputs) if len(prompt) < seq_len]
    ids = np.full((len(kept), seq_len), tokenizer.pad_id, dtype=dtype)
    lengths = np.zeros((len(kept), 2), dtype=np.int32)
    for row, (prompt, output) in enumerate(kept):
        tokens = np.concatenate([prompt, output, [tokenizer.eos_id]])[:seq_len]
        ids[row, : len(tokens)] = tokens
        lengths[row] = len(prompt), len(tokens)
    return ids, lengths


def _chat_rows(conversations: list[Conversation], tokenizer: Tokenizer, seq_len: int, dtype: np.dtype,
               skip_unrenderable: bool) -> EncodedSplit:
    """Each conversation rendered by the chat template as one right-padded row, cut after its last assistant turn
    that ends within seq_len when it is longer (dropped when none does); prompt length 0, labels by the mask."""
    chats = render_conversations(tokenizer, conversations, skip_unrenderable)
    rendered = [(chat, chat.fitted(seq_len)) for chat in chats]
    kept = [(chat, length) for chat, length in rendered if length is not None]
    ids = np.full((len(kept), seq_len), tokenizer.pad_id, dtype=dtype)
    lengths = np.zeros((len(kept), 2), dtype=np.int32)
    label_mask = np.zeros((len(kept), seq_len), dtype=np.uint8)
    for row, (chat, length) in enumerate(kept):
        ids[row, :length] = chat.ids[:length]
        label_mask[row, :length] = chat.mask[:length]
        lengths[row] = 0, length
    truncated = sum(length < len(chat.ids) for chat, length in kept)
    return EncodedSplit(ids, lengths, len(conversations), label_mask, truncated, len(conversations) - len(chats))

