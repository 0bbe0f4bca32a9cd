"""`preinfer train`: train the blocks above a cache's boundary from its stored boundary states."""

from __future__ import annotations

import argparse

from preinfer.errors import UsageError
from pipelines.flags import (
    STORE_FLAGS, add_flags, add_training_flags, print_summary, use_s3_endpoint,
)
from pipelines import training
from pipelines.training.run_directory import run_config


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_training_flags(parser, extra=STORE_FLAGS, skip=("--data", "--seq-len", "--eval-fraction", "--max-samples",
                                                        "--samples-per-shard"))
    add_flags(parser, "--s3-endpoint", "--resume")


def run(args: argparse.Namespace) -> int:
    use_s3_endpoint(args)
    config = run_config(args)
    if config.store.path is None:
        raise UsageError("--store is required: a cache directory written by `preinfer cache`")
    print_summary(training.run(config, resume=args.resume), config)
    return 0
