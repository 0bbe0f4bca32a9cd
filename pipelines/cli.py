"""The `preinfer` command line: one subcommand per job; errors become one line and an exit code."""

from __future__ import annotations

import argparse
import importlib
import sys

from preinfer.errors import PreinferError, UsageError
from storage import StorageError

# Subcommand name -> module in `pipelines.commands` defining `add_arguments(parser)` and `run(args) -> int`.
COMMANDS = {
    "bcd": ("bcd", "train a model by block coordinate descent (or --mode full), with pre-inference"),
    "tokenize": ("tokenize", "tokenise a corpus once into a token store on disk (sharded, resumable, parallel)"),
    "cache": ("cache", "pre-inference: run the frozen prefix once and store the boundary states (or roll forward)"),
    "train": ("train", "train the blocks above a cache's boundary from its stores, never loading the prefix"),
    "inspect": ("inspect", "describe an activation store or cache directory: samples, fields, size, fingerprint"),
    "verify": ("verify", "check every shard of a store; with --model and --data, recompute samples and compare"),
    "eval": ("eval", "evaluate a model or run directory on a dataset's eval split"),
    "plan": ("plan", "memory per GPU, automatic UFP, store size, pre-inference break-even and cost for a model"),
    "demo": ("demo", "the main job on the built-in defaults: BCD of small-llama, prefix live against pre-inference"),
}


class ArgumentParser(argparse.ArgumentParser):
    """argparse with a one-line error (no usage dump) and exit code 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(
        prog="preinfer",
        description="Block coordinate descent training with pre-inference (cached prefix activations).",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=ArgumentParser)
    for name, (module_name, help_text) in COMMANDS.items():
        module = importlib.import_module(f"pipelines.commands.{module_name}")
        command = sub.add_parser(name, help=help_text, description=help_text)
        module.add_arguments(command)
        command.set_defaults(run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.run(args) or 0
    except UsageError as err:
        print(f"preinfer {args.command}: error: {err}", file=sys.stderr)
        return 2
    except (PreinferError, StorageError) as err:
        print(f"preinfer {args.command}: error: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"preinfer {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
