"""The `preinfer` command line: one subcommand per job; errors become one line and an exit code
(`pipelines.jobs.errors`).

Only the chosen command's module is imported (`preinfer plan --model 7b` loads neither torch nor transformers),
and process-wide settings are made here, before that module loads torch, never on import of a library module.
"""

from __future__ import annotations

import argparse
import ctypes
import importlib
import logging
import os
import sys

from pipelines.jobs.errors import run_command

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

# Environment the command line sets for its own process (and the workers it starts) unless the user's
# environment already does. OpenMP threads that sleep instead of spinning while they wait: on small machines
# whose cores are shared with the store reader's threads or other jobs, spinning workers slowed a small-llama
# forward 3-13x (bench/train.py) and a small-llama Adam step 4x (OpenMP's default: 4.78 s, PASSIVE 1.18 s, on
# 2 busy cores; docs/results.md, "The hot path"). On idle cores spinning is faster (issue 12: 155 ms against
# 235 ms); set OMP_WAIT_POLICY there. OpenMP reads it when torch loads.
#
# glibc's malloc serves an allocation below its mmap threshold from its heap and keeps the freed memory there. The
# threshold starts at 128 KiB and rises to the size of each freed mmap-ed block, up to 32 MiB, so after the first
# large tensors are freed every later tensor up to 32 MiB (an 8-bit step's chunks, a layer's activations) stays in
# the heap when freed: on SmolLM2-1.7B with nf4 frozen layers and the 8-bit fused step the process held 2.5 GiB
# above the planner's figure, 0.8 GiB of it such freed memory. A fixed threshold of 4 MiB returns every tensor of
# 4 MiB or more to the system when it is freed (docs/precision-and-memory.md, "The largest scale"). glibc reads the
# variable when a process starts: `bound_heap` sets the same threshold in this process.
MMAP_THRESHOLD = 4 << 20
M_MMAP_THRESHOLD = -3  # mallopt's parameter number in glibc's malloc.h
PROCESS_ENVIRONMENT = {"OMP_WAIT_POLICY": "PASSIVE", "MALLOC_MMAP_THRESHOLD_": str(MMAP_THRESHOLD)}
# Loggers that warn while transformers imports them, about nothing a run can act on: torchao (the `quant` extra) on
# its CUDA-only kernels this machine cannot load, torch's pytree on a deprecation. Raised to ERROR before a command's
# module loads, unless the command line asks for --verbose.
IMPORT_WARNINGS = ("torchao", "torch.utils._pytree")


class ArgumentParser(argparse.ArgumentParser):
    """argparse with a one-line error (no usage dump) and exit code 2; each flag's help, its default included, is
    written once in `pipelines.flag_table` and `pipelines.command_flags`."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")


class CommandParser(ArgumentParser):
    """A subcommand's parser: imports its module and adds its flags only when the command is chosen."""

    def __init__(self, *args, module: str, **kwargs):
        super().__init__(*args, **kwargs)
        self.module, self.loaded = module, False

    def load(self) -> None:
        """Import the command's module and add its flags (once)."""
        if not self.loaded:
            command = importlib.import_module(f"pipelines.commands.{self.module}")
            command.add_arguments(self)
            self.set_defaults(run=command.run)
            self.loaded = True

    def parse_known_args(self, args: list[str] | None = None, namespace: argparse.Namespace | None = None
                         ) -> tuple[argparse.Namespace, list[str]]:
        self.load()
        return super().parse_known_args(args, namespace)


def build_parser() -> ArgumentParser:
    """The `preinfer` parser; a command's module loads when its arguments are parsed."""
    parser = ArgumentParser(
        prog="preinfer",
        description="Block coordinate descent training with pre-inference (cached prefix activations).",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=CommandParser)
    for name, (module_name, help_text) in COMMANDS.items():
        command = sub.add_parser(name, module=module_name, help=help_text, description=help_text)
        command.add_argument("--verbose", action="store_true",
                             help="also show the framework's messages (transformers' load report and warnings)")
    return parser


def command_parsers() -> dict[str, CommandParser]:
    """Each subcommand's parser, by name, with its flags added (the generated reference reads them)."""
    parser = build_parser()
    sub = next(action for action in parser._actions if isinstance(action, argparse._SubParsersAction))
    for command in sub.choices.values():
        command.load()
    return dict(sub.choices)


def set_process_environment() -> None:
    """PROCESS_ENVIRONMENT, where the environment does not set it already, for this process and its children."""
    if "MALLOC_MMAP_THRESHOLD_" not in os.environ:  # else glibc took the user's at this process's start
        bound_heap(MMAP_THRESHOLD)
    for key, value in PROCESS_ENVIRONMENT.items():
        os.environ.setdefault(key, value)


def bound_heap(threshold: int) -> None:
    """Set glibc's mmap threshold of this process to `threshold` bytes (see PROCESS_ENVIRONMENT), which also stops
    glibc raising it; nothing where the C library has no `mallopt`."""
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)
    if mallopt is not None:
        mallopt(M_MMAP_THRESHOLD, threshold)


def hide_import_warnings() -> None:
    """Raise IMPORT_WARNINGS' loggers to ERROR."""
    for name in IMPORT_WARNINGS:
        logging.getLogger(name).setLevel(logging.ERROR)


def show_framework_messages() -> None:
    """Print what `preinfer`'s loggers say at INFO (the framework's messages, `preinfer.model_config.FRAMEWORK_LOG`)
    to stderr."""
    logger = logging.getLogger("preinfer")
    if not logger.handlers:
        logger.addHandler(logging.StreamHandler(sys.stderr))
    logger.setLevel(logging.INFO)


def asks_for_verbose(argv: list[str] | None) -> bool:
    """Whether the command line gives --verbose, read before a command's module (and what it imports) loads."""
    verbose = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    verbose.add_argument("--verbose", action="store_true")
    return verbose.parse_known_args(argv)[0].verbose


def main(argv: list[str] | None = None) -> int:
    set_process_environment()
    if not asks_for_verbose(argv):
        hide_import_warnings()
    args = build_parser().parse_args(argv)
    if args.verbose:
        show_framework_messages()
    return run_command(args.command, lambda: args.run(args))


if __name__ == "__main__":
    sys.exit(main())
