"""The token data of a job: `--data` is either a token store written by `preinfer tokenize` (used as it is, after
checking that it was made with the job's tokenizer, seq_len and eval fraction) or a corpus, whose token store is
found in (or, the first time, built into) the token-store cache: `--token-store DIR`, by default
`$XDG_CACHE_HOME/preinfer/tokens` (`~/.cache/preinfer/tokens`), one directory per fingerprint (corpus content,
tokenizer and settings), so every job and every run of the same data shares one build."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from pipelines.data.token_store.dataset import TokenStoreDataset, open_token_store
from pipelines.data.token_store.job import cache_path, token_fingerprint, tokenize_corpus
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


def token_store_path(data: str, tokenizer: Tokenizer, seq_len: int, eval_fraction: float, root: str | None = None,
                     progress: bool = True) -> Path:
    """The complete token store of `data` for these settings: `data` itself when it is one (refused if it was made
    otherwise), else the cache's, tokenised now if it is not there yet (with a progress bar on a terminal)."""
    if is_token_store(data):
        check_token_store(open_token_store(data), data, tokenizer, seq_len, eval_fraction)
        return Path(data)
    fingerprint = token_fingerprint(data, tokenizer, seq_len, eval_fraction)
    path = cache_path(root or default_token_root(), fingerprint)
    if read_info(path) is None:
        tokenize_corpus(TokenizeOptions(data=data, tokenizer=tokenizer.name, chat_template=tokenizer.chat_template_file,
                                        seq_len=seq_len,
                                        eval_fraction=eval_fraction, out=str(path),
                                        progress=progress and sys.stderr.isatty()))
    return path


def check_token_store(info: TokenStoreInfo, data: str, tokenizer: Tokenizer, seq_len: int,
                      eval_fraction: float) -> None:
    """Refuse, in one line, a token store made with another tokenizer, seq_len or eval fraction than the job's."""
    parts = info.fingerprint["parts"]
    if parts.get("tokenizer_digest") != tokenizer.fingerprint():
        raise UsageError(f"--data {data} is a token store made with tokenizer {parts.get('tokenizer')!r}, not with "
                         f"--tokenizer {tokenizer.name!r}; pass that tokenizer or tokenize the corpus again")
    if info.seq_len != seq_len:
        raise UsageError(f"--data {data} is a token store of {info.seq_len}-token samples, not of --seq-len "
                         f"{seq_len}; pass --seq-len {info.seq_len} or tokenize the corpus again")
    if parts.get("eval_fraction") != eval_fraction:
        raise UsageError(f"--data {data} is a token store split with eval fraction {parts.get('eval_fraction')}, "
                         f"not {eval_fraction}; pass --eval-fraction {parts.get('eval_fraction')}")


def token_splits(data: str, tokenizer: Tokenizer, seq_len: int, eval_fraction: float, splits: list[str],
                 root: str | None = None, progress: bool = True) -> dict[str, TokenStoreDataset]:
    """The named splits of `data`'s token store (see `token_store_path`), read lazily."""
    path = token_store_path(data, tokenizer, seq_len, eval_fraction, root, progress)
    return {split: TokenStoreDataset(path, split) for split in splits}


def data_splits(data: DataConfig, tokenizer: Tokenizer, splits: list[str], progress: bool = True
                ) -> dict[str, TokenStoreDataset]:
    """The named splits of a run's data (its corpus, sequence length, held-out share and token store root), read
    lazily; a corpus that cannot be read is a UsageError naming it."""
    try:
        return token_splits(data.path, tokenizer, data.seq_len, data.eval_fraction, splits, data.token_store,
                            progress)
    except OSError as err:
        raise UsageError(f"{err.filename or data.path}: cannot read it ({type(err).__name__}: "
                         f"{err.strerror or err})") from None


def eval_samples(eval_tokens: int, seq_len: int) -> int | None:
    """Samples of the capped eval subset (its first samples in stored order, the same every visit); None: all."""
    return -(-eval_tokens // seq_len) if eval_tokens else None
