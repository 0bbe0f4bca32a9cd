"""The token data of a job: `--data` is either a token store written by `preinfer tokenize` (used as it is, after
checking that it was made with the job's tokenizer, seq_len and eval fraction) or a corpus, whose token store is
found in (or, the first time, built into) the token-store cache: `--token-store DIR`, by default
`$XDG_CACHE_HOME/preinfer/tokens` (`~/.cache/preinfer/tokens`), one directory per fingerprint (corpus content,
dataset split, tokenizer and settings), so every job and every run of the same data shares one build."""

from __future__ import annotations

import os
import sys
from dataclasses import replace
from pathlib import Path

from pipelines.data.corpus import CorpusDigest
from pipelines.data.corpus_files import DEFAULT_SPLIT
from pipelines.data.token_store.dataset import TokenStoreDataset, open_token_store
from pipelines.data.token_store.job import cache_path, options_fingerprint, tokenize_corpus
from pipelines.data.token_store.options import TokenizeOptions
from pipelines.data.token_store.layout import INFO, TokenStoreInfo, read_info
from preinfer.config import DataConfig
from preinfer.errors import UsageError
from pipelines.data.tokenizers import Tokenizer


def default_token_root() -> Path:
    """The token-store cache when none is given: `$XDG_CACHE_HOME/preinfer/tokens`, else `~/.cache/...`."""
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "preinfer" / "tokens"


def is_token_store(data: str) -> bool:
    """Whether `data` names a token store directory (rather than a corpus)."""
    return not data.startswith("builtin:") and (Path(data) / INFO).is_file()


def token_store_path(options: TokenizeOptions, tokenizer: Tokenizer, root: str | None = None,
                     corpus: CorpusDigest | None = None) -> Path:
    """The complete token store of `options.data` for these options: the data itself when it is one (refused if it
    was made otherwise), else the cache's, tokenised now if it is not there yet. `corpus`: the corpus's
    fingerprint where the caller has it already (`corpus_fingerprint`), so the corpus is read for it once."""
    if is_token_store(options.data):
        check_token_store(open_token_store(options.data), options, tokenizer)
        return Path(options.data)
    fingerprint = options_fingerprint(options, tokenizer, corpus)
    path = cache_path(root or default_token_root(), fingerprint)
    if read_info(path) is None:
        tokenize_corpus(replace(options, out=str(path)), fingerprint)
    return path


def check_token_store(info: TokenStoreInfo, options: TokenizeOptions, tokenizer: Tokenizer) -> None:
    """Refuse, in one line, a token store made with another tokenizer, seq_len, eval fraction or dataset split than
    the job's."""
    parts, data = info.fingerprint["parts"], options.data
    if parts.get("tokenizer_digest") != tokenizer.fingerprint():
        raise UsageError(f"--data {data} is a token store made with tokenizer {parts.get('tokenizer')!r}, not with "
                         f"--tokenizer {tokenizer.name!r}; pass that tokenizer or tokenize the corpus again")
    if info.seq_len != options.seq_len:
        raise UsageError(f"--data {data} is a token store of {info.seq_len}-token samples, not of --seq-len "
                         f"{options.seq_len}; pass --seq-len {info.seq_len} or tokenize the corpus again")
    if parts.get("eval_fraction") != options.eval_fraction:
        raise UsageError(f"--data {data} is a token store split with eval fraction {parts.get('eval_fraction')}, "
                         f"not {options.eval_fraction}; pass --eval-fraction {parts.get('eval_fraction')}")
    made_from = parts.get("dataset_split", DEFAULT_SPLIT)  # a store made before the split was recorded: train
    if made_from != options.dataset_split:
        raise UsageError(f"--data {data} is a token store of the dataset split '{made_from}', not of --dataset-split "
                         f"{options.dataset_split}; pass --dataset-split {made_from} or tokenize that split")


def token_splits(data: str, tokenizer: Tokenizer, seq_len: int, eval_fraction: float, splits: list[str],
                 root: str | None = None, progress: bool = True, *, dataset_split: str = DEFAULT_SPLIT,
                 skip_unrenderable: bool = False, corpus: CorpusDigest | None = None
                 ) -> dict[str, TokenStoreDataset]:
    """The named splits of `data`'s token store (see `token_store_path`), read lazily; built with a progress bar
    on a terminal."""
    options = TokenizeOptions(data=data, tokenizer=tokenizer.name, chat_template=tokenizer.chat_template_file,
                              chat_template_name=tokenizer.chat_template_name, seq_len=seq_len,
                              eval_fraction=eval_fraction, dataset_split=dataset_split,
                              skip_unrenderable=skip_unrenderable, progress=progress and sys.stderr.isatty())
    path = token_store_path(options, tokenizer, root, corpus)
    return {split: TokenStoreDataset(path, split) for split in splits}


def data_splits(data: DataConfig, tokenizer: Tokenizer, splits: list[str], progress: bool = True,
                corpus: CorpusDigest | None = None) -> dict[str, TokenStoreDataset]:
    """The named splits of a run's data (its corpus, dataset split, sequence length, held-out share and token store
    root), read lazily; a corpus that cannot be read is a UsageError naming it. `corpus` as `token_store_path`."""
    try:
        return token_splits(data.path, tokenizer, data.seq_len, data.eval_fraction, splits, data.token_store,
                            progress, dataset_split=data.dataset_split, skip_unrenderable=data.skip_unrenderable,
                            corpus=corpus)
    except OSError as err:
        raise UsageError(f"{err.filename or data.path}: cannot read it ({type(err).__name__}: "
                         f"{err.strerror or err})") from None


def eval_samples(eval_tokens: int, seq_len: int) -> int | None:
    """Samples of the capped eval subset (its first samples in stored order, the same every visit); None: all."""
    return -(-eval_tokens // seq_len) if eval_tokens else None
