"""`preinfer bcd`: block coordinate descent training of a whole model."""

from __future__ import annotations

import argparse

from pipelines import training
from pipelines.arguments import add_s3_endpoint, use_s3_endpoint
from pipelines.flags import PRE_INFERENCE_FLAGS, add_training_flags, config_for_command, print_summary


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_training_flags(parser, extra=PRE_INFERENCE_FLAGS)
    add_s3_endpoint(parser)
    parser.add_argument("--resume", action="store_true",
                        help="continue the run in --out from its last checkpoint (its config.toml, then flags)")


def run(args: argparse.Namespace) -> int:
    use_s3_endpoint(args)
    config = config_for_command(args)
    print_summary(training.run(config, resume=args.resume), config)
    return 0
