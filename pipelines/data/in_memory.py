"""The samples of a corpus read directly, without a token store: whole in memory (`load_data`, a `TokenDataset`)
or block by block in bounded memory (`sample_blocks`).

A public helper for Python use (tests, benchmarks, notebooks) on small inputs; the commands read a token store
(`pipelines.data.token_store`), whose `TokenStoreDataset` has `TokenDataset`'s interface and decodes to the same
samples. How documents become samples: `pipelines.data.samples`.

    from pipelines.data.in_memory import load_data
    from pipelines.data.tokenizers import load_tokenizer

    data = load_data("builtin:pydoc", load_tokenizer("byte"), seq_len=64, split="train")
    batch = data[:8]  # {"input_ids", "attention_mask", "labels"}: [8, 64] each
"""

from __future__ import annotations

import hashlib
import json
import operator
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

from pipelines.data.corpus import iter_documents
from pipelines.data.sample_blocks import SampleBlock, SamplePacker
from pipelines.data.samples import check_arguments, document_chunks, encode_chunk, sample_kind
from pipelines.data.tokenizers import Tokenizer
from preinfer.errors import UsageError

BLOCK_SAMPLES = 4096  # samples per block of `sample_blocks` by default
_FINGERPRINT_VERSION = 1


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
    spec: str, tokenizer: Tokenizer, seq_len: int, split: str = "train", eval_fraction: float = 0.1,
    text_column: str = "text",
) -> TokenDataset:
    """The `split` of the data at `spec`, tokenised into samples of `seq_len` tokens, as in-memory tensors."""
    blocks = list(sample_blocks(spec, tokenizer, seq_len, split, eval_fraction, text_column=text_column))
    ids = np.concatenate([block.ids for block in blocks])
    lengths = None if blocks[0].lengths is None else np.concatenate([block.lengths for block in blocks])
    label_mask = None if blocks[0].label_mask is None else np.concatenate([block.label_mask for block in blocks])
    tensors = SampleBlock(ids, lengths, label_mask).tensors()
    return TokenDataset(**tensors, source=spec, split=split)


def sample_blocks(
    spec: str, tokenizer: Tokenizer, seq_len: int, split: str = "train", eval_fraction: float = 0.1,
    block_samples: int = BLOCK_SAMPLES, text_column: str = "text",
) -> Iterator[SampleBlock]:
    """The samples of `split`, in blocks of `block_samples` (the last may be shorter), read and tokenised one chunk
    of documents at a time: the samples of `load_data`, in bounded memory."""
    check_arguments(seq_len, split, eval_fraction)
    packer = None
    for chunk in document_chunks(iter_documents(spec, text_column)):
        packer = packer or SamplePacker(seq_len, sample_kind(chunk[0], tokenizer), block_samples)
        yield from packer.add(encode_chunk(chunk, tokenizer, seq_len, eval_fraction, (split,))[split])
    if packer is None:
        raise UsageError(f"{spec}: no documents found (empty dataset)")
    yield from packer.finish()
    packer.check(f"{spec} ({split})")
