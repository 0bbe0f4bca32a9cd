"""`preinfer bcd`: block coordinate descent training of a whole model."""

from __future__ import annotations

import argparse

from pipelines.flags import (
    PRE_INFERENCE_FLAGS, add_flags, add_training_flags, print_summary, use_s3_endpoint,
)
from pipelines import training
from pipelines.training.run_directory import run_config


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_training_flags(parser, extra=PRE_INFERENCE_FLAGS)
    add_flags(parser, "--s3-endpoint", "--resume")


def run(args: argparse.Namespace) -> int:
    use_s3_endpoint(args)
    config = run_config(args)
    print_summary(training.run(config, resume=args.resume), config)
    return 0
