"""What a tokenize job is asked to do (`TokenizeOptions`)."""

from __future__ import annotations

from dataclasses import dataclass

from pipelines.data.corpus_files import DEFAULT_SPLIT
from pipelines.data.samples import CHUNK_CHARS, check_arguments
from pipelines.data.tokenizers import Tokenizer, load_tokenizer
from preinfer.config.rules import SPLIT_NAME
from preinfer.errors import UsageError


@dataclass(frozen=True)
class TokenizeOptions:
    """What to tokenise, how, and where to."""

    data: str = "builtin:pydoc"
    tokenizer: str = "byte"
    chat_template: str | None = None  # a file whose chat template replaces the tokenizer's own
    chat_template_name: str | None = None  # which of the tokenizer's named templates; None: default (or the only one)
    dataset_split: str = DEFAULT_SPLIT  # the split of a dataset folder or repository that is read
    skip_unrenderable: bool = False  # skip (and count) the conversations the chat template cannot render
    seq_len: int = 128
    eval_fraction: float = 0.1
    out: str = "tokens"
    text_column: str = "text"
    workers: int = 1
    samples_per_shard: int | None = None  # None: about 4 MiB of ids per shard
    overwrite: bool = False
    progress: bool = True
    chunk_chars: int = CHUNK_CHARS  # characters of documents per unit of work (tests make it small)

    def load_tokenizer(self) -> Tokenizer:
        """The tokenizer these options name, with their chat template."""
        return load_tokenizer(self.tokenizer, self.chat_template, self.chat_template_name)

    def check(self) -> None:
        """Refuse options no job can run with, in one line naming the flag."""
        check_arguments(self.seq_len, "train", self.eval_fraction)
        if self.workers < 1:
            raise UsageError(f"--workers must be at least 1, got {self.workers}")
        if self.samples_per_shard is not None and self.samples_per_shard < 1:
            raise UsageError(f"--samples-per-shard must be at least 1, got {self.samples_per_shard}")
        if not self.text_column:
            raise UsageError("--text-column must name a field, got ''")
        if not SPLIT_NAME.fullmatch(self.dataset_split):
            raise UsageError(f"--dataset-split {self.dataset_split!r}: expected a split name such as train, validation "
                             f"or test (letters, digits, _ and .)")
        if self.chunk_chars < 1:
            raise UsageError(f"chunk_chars must be at least 1, got {self.chunk_chars}")
