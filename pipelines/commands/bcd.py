"""`preinfer bcd`: block coordinate descent training of a whole model."""

from __future__ import annotations

import argparse
from pathlib import Path

from pipelines.flags import add_training_flags, config_from_args
from pipelines.training import run_bcd


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_training_flags(parser)
    parser.add_argument("--resume", action="store_true",
                        help="continue the run in --out from its last checkpoint (its config.toml, then flags)")


def run(args: argparse.Namespace) -> int:
    if args.resume and args.run__out is not None:
        config = config_from_args(args, path=str(Path(args.run__out) / "config.toml"))
    else:
        config = config_from_args(args)
    if config.stop.steps_per_visit is None and config.stop.epochs_per_visit is None and config.stop.patience is None:
        config.stop.epochs_per_visit = 1.0
    summary = run_bcd(config, resume=args.resume)
    print(f"final eval loss {summary['final_eval_loss']:.4f} (ppl {summary['final_eval_ppl']:.2f}) after "
          f"{summary['steps']} steps, {summary['tokens']:,} tokens, {summary['wall_s']:.1f} s; run in {config.run.out}")
    return 0
