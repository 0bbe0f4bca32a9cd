"""Samples in compact form and the packer that cuts them into blocks: `SampleBlock` (what a token store's shard
holds), `EncodedSplit` (one split's share of a tokenised chunk) and `SamplePacker`. How documents become samples:
`pipelines.data.samples`.

Compact form: token ids in the smallest integer dtype of the vocabulary, plus, for instruction and chat data, each
sample's prompt length and length, and for chat data its assistant mask (uint8); `SampleBlock.tensors` recovers the
exact int64 ids, bool mask and int64 labels.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from preinfer.errors import UsageError

logger = logging.getLogger(__name__)

LM, INSTRUCTION, CHAT = "lm", "instruction", "chat"  # kinds of samples
IGNORE_INDEX = -100

@dataclass(frozen=True)
class SampleBlock:
    """Consecutive samples in compact form: ids [n, seq_len] in the vocabulary's id dtype; for instruction and chat
    data also `lengths` [n, 2] int32, each sample's (prompt length, length), and for chat data `label_mask`
    [n, seq_len] uint8, 1 on the tokens the loss covers; LM text has neither padding nor prompt."""

    ids: np.ndarray
    lengths: np.ndarray | None = None
    label_mask: np.ndarray | None = None

    def __len__(self) -> int:
        return self.ids.shape[0]

    @property
    def tokens(self) -> int:
        """Real (unpadded) tokens."""
        return real_tokens(self.ids, self.lengths)

    def tensors(self) -> dict[str, torch.Tensor]:
        """The trainer's tensors: input_ids int64, attention_mask bool (real tokens), labels int64 (-100 on prompt
        and padding, and outside the assistant mask of chat data)."""
        input_ids = torch.from_numpy(self.ids.astype(np.int64))
        if self.lengths is None:
            mask = torch.ones_like(input_ids, dtype=torch.bool)
            return {"input_ids": input_ids, "attention_mask": mask, "labels": input_ids.clone()}
        positions = torch.arange(input_ids.shape[1])
        lengths = torch.from_numpy(self.lengths.astype(np.int64))
        mask = positions < lengths[:, 1:]
        supervised = mask & (positions >= lengths[:, :1])
        if self.label_mask is not None:
            supervised &= torch.from_numpy(self.label_mask.astype(bool))
        labels = torch.where(supervised, input_ids, IGNORE_INDEX)
        return {"input_ids": input_ids, "attention_mask": mask, "labels": labels}


@dataclass(frozen=True)
class EncodedSplit:
    """One split's share of a chunk of documents, tokenised: LM text as one stream of ids (each document followed by
    eos); instruction and chat data as padded rows [kept, seq_len] with their (prompt length, length) [kept, 2], chat
    data also with its assistant mask [kept, seq_len]."""

    ids: np.ndarray
    lengths: np.ndarray | None
    documents: int  # documents (or examples, dropped ones included) of the split in the chunk
    label_mask: np.ndarray | None = None
    truncated: int = 0  # conversations cut at a turn boundary to fit seq_len
    skipped: int = 0  # conversations the chat template cannot render, left out (--skip-unrenderable)

    @property
    def tokens(self) -> int:
        """Real (unpadded) tokens."""
        return real_tokens(self.ids, self.lengths)


def real_tokens(ids: np.ndarray, lengths: np.ndarray | None) -> int:
    """Real tokens of ids in compact form: all of them, or the sum of the lengths (instruction rows)."""
    return ids.size if lengths is None else int(lengths[:, 1].sum())


class SamplePacker:
    """Cuts one split's encoded chunks, added in corpus order, into samples handed out in blocks of `block_samples`:
    LM streams packed across chunk ends, instruction and chat rows as they are. Counts what it saw, for `check`."""

    def __init__(self, seq_len: int, kind: str, block_samples: int) -> None:
        self.seq_len, self.kind, self.block_samples = seq_len, kind, block_samples
        self.instruction = kind != LM  # rows of padded samples
        self.documents = 0  # documents (examples) added
        self.units = 0  # tokens of the LM stream, or rows of instruction data, added
        self.truncated = 0  # conversations cut at a turn boundary
        self.skipped = 0  # conversations the chat template cannot render, left out
        self.samples = 0  # samples handed out
        self._pending: list[EncodedSplit] = []

    @property
    def _units_per_sample(self) -> int:
        return 1 if self.instruction else self.seq_len

    def add(self, part: EncodedSplit) -> list[SampleBlock]:
        """The blocks completed by `part`."""
        self.documents += part.documents
        self.units += len(part.ids)
        self.truncated += part.truncated
        self.skipped += part.skipped
        self._pending.append(part)
        return self._blocks(final=False)

    def finish(self) -> list[SampleBlock]:
        """The last, shorter block (if any samples are left); an LM stream's tail shorter than seq_len is dropped."""
        return self._blocks(final=True)

    def _blocks(self, final: bool) -> list[SampleBlock]:
        per_sample = self._units_per_sample
        block_units = self.block_samples * per_sample
        pending = sum(len(part.ids) for part in self._pending)
        usable = pending // (per_sample if final else block_units) * (per_sample if final else block_units)
        if not usable:
            return []
        ids = np.concatenate([part.ids for part in self._pending])
        lengths = np.concatenate([part.lengths for part in self._pending]) if self.instruction else None
        masks = np.concatenate([part.label_mask for part in self._pending]) if self.kind == CHAT else None
        blocks = []
        for start in range(0, usable, block_units):
            stop = min(start + block_units, usable)
            rows = None if lengths is None else lengths[start:stop]
            label_mask = None if masks is None else masks[start:stop]
            blocks.append(SampleBlock(ids[start:stop].reshape(-1, self.seq_len), rows, label_mask))
        self._pending = [EncodedSplit(ids[usable:].copy(), None if lengths is None else lengths[usable:].copy(), 0,
                                      None if masks is None else masks[usable:].copy())]
        self.samples += sum(len(block) for block in blocks)
        return blocks

    def report(self, where: str) -> str | None:
        """Log a warning for dropped instruction examples; return why the split has no samples, in one line (None
        when it has some)."""
        if not self.instruction:
            if self.samples:
                return None
            return (
                f"{where}: {self.units} tokens in {self.documents} documents, fewer than one full sequence of "
                f"seq_len={self.seq_len}"
            )
        dropped = self.documents - self.units - self.skipped
        if self.kind == CHAT:
            return self._chat_report(where, dropped)
        if dropped:
            logger.warning(
                "%s: dropped %d of %d instruction examples whose prompt fills all seq_len=%d tokens (no response "
                "left)", where, dropped, self.documents, self.seq_len,
            )
        if self.samples:
            return None
        return (
            f"{where}: no instruction example left ({self.documents} in this split, {dropped} dropped because the "
            f"prompt fills seq_len={self.seq_len})"
        )

    def _chat_report(self, where: str, dropped: int) -> str | None:
        if dropped or self.truncated or self.skipped:
            logger.warning("%s: %s", where, chat_fit_line(self.documents, self.truncated, dropped, self.seq_len,
                                                         self.skipped))
        if self.samples:
            return None
        skipped = f"; {self.skipped} skipped: the chat template cannot render them" if self.skipped else ""
        return (f"{where}: no conversation left ({self.documents} in this split, {dropped} dropped: none has an "
                f"assistant turn ending within seq_len={self.seq_len}{skipped})")

    def check(self, where: str) -> None:
        """Raise a one-line UsageError if the split has no samples (see `report`)."""
        problem = self.report(where)
        if problem:
            raise UsageError(problem)


def chat_fit_line(conversations: int, truncated: int, dropped: int, seq_len: int, skipped: int = 0) -> str:
    """What the seq_len rule (and --skip-unrenderable) did to a split's conversations, in words."""
    line = (f"{conversations} conversations: {truncated} cut after their last assistant turn ending within "
            f"seq_len={seq_len}, {dropped} dropped (no assistant turn ends within it)")
    return f"{line}, {skipped} skipped (the chat template cannot render them)" if skipped else line
