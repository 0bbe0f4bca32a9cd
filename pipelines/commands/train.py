"""`preinfer train`: train the blocks above a cache's boundary from its stored boundary states."""

from __future__ import annotations

import argparse

from preinfer.errors import UsageError
from pipelines.flags import add_training_flags, config_for_command, summary_line
from pipelines.training import run_from_store


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--store", dest="store__path", metavar="CACHE",
                        help="cache directory written by `preinfer cache` (its train and eval stores); its "
                             "boundary K is where the trained suffix begins")
    add_training_flags(parser, skip=("--data", "--tokenizer", "--seq-len", "--eval-fraction", "--max-samples",
                                     "--samples-per-shard"))
    parser.add_argument("--trust-store", dest="store__trust", action="store_const", const=True,
                        help="use the store even if the model's weights below K differ from the ones it was "
                             "made from")
    parser.add_argument("--resume", action="store_true", help="continue the run in --out from its checkpoint")


def run(args: argparse.Namespace) -> int:
    config = config_for_command(args)
    if config.store.path is None:
        raise UsageError("--store is required: a cache directory written by `preinfer cache`")
    print(summary_line(run_from_store(config, resume=args.resume), config))
    return 0
