"""`preinfer bcd`: block coordinate descent training of a whole model."""

from __future__ import annotations

import argparse

from pipelines.arguments import add_s3_endpoint, use_s3_endpoint
from pipelines.flags import PRE_INFERENCE_FLAGS, add_training_flags, config_for_command, print_summary
from pipelines.training import run_bcd


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_training_flags(parser, extra=PRE_INFERENCE_FLAGS)
    add_s3_endpoint(parser)
    parser.add_argument("--resume", action="store_true",
                        help="continue the run in --out from its last checkpoint with its own config.toml; flags may "
                             "change only --checkpoint-every, --device, --token-store, --dask and (to train on) "
                             "--sweeps, each recorded in metrics.jsonl")


def run(args: argparse.Namespace) -> int:
    use_s3_endpoint(args)
    config = config_for_command(args)
    if config.run.pipeline > 1:
        from pipelines.pipeline_parallel import run_pipeline_bcd  # torch.distributed.pipelining loads only for pipelines

        summary = run_pipeline_bcd(config, resume=args.resume)
    else:
        summary = run_bcd(config, resume=args.resume)
    print_summary(summary, config)
    return 0
