"""The data flags of the commands that read a dataset beside a model (`cache`, `eval`, `verify`): each defaults to
the run directory's value; the splits come from the token store (`pipelines.data.token_store.resolve`)."""

from __future__ import annotations

import argparse

from preinfer.config import Config, DataConfig, ModelConfig
from preinfer.errors import UsageError
from pipelines.data.tokenizers import Tokenizer
from pipelines.arguments import run_or
from pipelines.data.token_store import TokenStoreDataset
from pipelines.data.token_store.resolve import token_splits

DATA_HELP = "a corpus as in `bcd --data`, or a token store written by preinfer tokenize"


def add_data_arguments(parser: argparse.ArgumentParser) -> None:
    """--data, --tokenizer, --eval-fraction and --token-store."""
    parser.add_argument("--data", help=f"{DATA_HELP} {run_or(DataConfig.path)}")
    parser.add_argument("--tokenizer", help=f"tokenizer as in `bcd --tokenizer` {run_or(ModelConfig.tokenizer)}")
    parser.add_argument("--eval-fraction", type=float,
                        help=f"share of documents held out {run_or(DataConfig.eval_fraction)}")
    parser.add_argument("--token-store",
                        help="where a corpus is tokenised once and read from [the run's, else "
                             "$XDG_CACHE_HOME/preinfer/tokens]")


def data_splits(args: argparse.Namespace, base: Config, tokenizer: Tokenizer, seq_len: int, splits: list[str],
                progress: bool = True) -> dict[str, TokenStoreDataset]:
    """The named splits of the data the flags (else the run's config `base`) name, read lazily."""
    data = args.data or base.data.path
    fraction = args.eval_fraction if args.eval_fraction is not None else base.data.eval_fraction
    try:
        return token_splits(data, tokenizer, seq_len, fraction, splits, args.token_store or base.data.token_store,
                            progress)
    except OSError as err:
        raise UsageError(f"{err.filename or data}: cannot read it ({type(err).__name__}: {err.strerror or err})") \
            from None
