"""`preinfer train`: train the blocks above a cache's boundary from its stored boundary states."""

from __future__ import annotations

import argparse

from preinfer.errors import UsageError
from pipelines.arguments import add_s3_endpoint, use_s3_endpoint
from pipelines.flags import STORE_FLAGS, add_training_flags, config_for_command, print_summary
from pipelines.training import run_from_store


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_training_flags(parser, extra=STORE_FLAGS, skip=("--data", "--seq-len", "--eval-fraction", "--max-samples",
                                                        "--samples-per-shard"))
    add_s3_endpoint(parser)
    parser.add_argument("--resume", action="store_true",
                        help="continue the run in --out from its last checkpoint with its own config.toml; flags may "
                             "change only --checkpoint-every, --device and (to train on) --sweeps, each recorded in "
                             "metrics.jsonl")


def run(args: argparse.Namespace) -> int:
    use_s3_endpoint(args)
    config = config_for_command(args)
    if config.store.path is None:
        raise UsageError("--store is required: a cache directory written by `preinfer cache`")
    if config.run.pipeline > 1:
        from pipelines.pipeline_parallel import run_pipeline_train  # torch.distributed.pipelining loads only for pipelines

        print_summary(run_pipeline_train(config, resume=args.resume), config)
    else:
        print_summary(run_from_store(config, resume=args.resume), config)
    return 0
