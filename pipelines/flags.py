"""The command line's flags at work: a command's `add_arguments` takes its flags by name (`add_flags`, and
`add_training_flags` for `bcd` and `train`), and a run's config is made from them (`config_for_command`), validated
before any model, tokenizer or data is opened. The flags themselves are defined once, in `pipelines.flag_table`
(those that set a config key) and `pipelines.command_flags`. Torch-free at import, so that `preinfer plan` loads
without torch."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Iterable
from dataclasses import fields, replace
from typing import TYPE_CHECKING, Any

from preinfer.config import Config, DataConfig, load_config, load_resumed
from preinfer.errors import UsageError
from pipelines.command_flags import COMMAND_FLAGS, FLAGS, SHARED_FLAGS
from pipelines.flag_table import PRE_INFERENCE_FLAGS, STORE_FLAGS, TRAINING_FLAGS, Flag, shown
from pipelines.flag_types import device_problem, local_directory, store_location

if TYPE_CHECKING:
    from preinfer.run_dir import RunDir

__all__ = [
    "COMMAND_FLAGS", "CONFIG_FLAGS", "DATA_FLAGS", "FLAGS", "PRE_INFERENCE_FLAGS", "SHARED_FLAGS", "STORE_FLAGS",
    "TRAINING_FLAGS", "Flag", "add_flags", "add_training_flags", "config_for_command", "config_from_args",
    "data_flags", "flag", "option_defaults", "print_summary", "run_dir", "shown", "summary_line",
    "use_s3_endpoint",
]

# The flag that sets each config key, by "section.key".
CONFIG_FLAGS = {f"{each.section}.{each.key}": each.name for each in FLAGS.values() if each.section is not None}

# The data flags of the commands that read a dataset beside a model (`cache`, `eval`, `verify`).
DATA_FLAGS = ("--data", "--dataset-split", "--skip-unrenderable", "--tokenizer", "--eval-fraction", "--token-store")


def option_defaults(options: Any) -> dict[str, Any]:
    """The defaults of a job's options dataclass by flag name: {"--batch-size": 16, ...}."""
    return {"--" + each.name.replace("_", "-"): getattr(options, each.name) for each in fields(options)}


def flag(name: str, command: str | None = None) -> Flag:
    """The definition of `name` in `command`: its own, else the one every command shares."""
    own = {f.name: f for f in COMMAND_FLAGS.get(command, [])}
    return own.get(name) or FLAGS[name]


def add_training_flags(parser: argparse.ArgumentParser, extra: list[Flag] = (), skip: tuple[str, ...] = ()) -> None:
    """--config, every training flag and `extra`, defaulting to None so that the config file and the defaults show
    through."""
    add_flags(parser, "--config")
    for each in [*TRAINING_FLAGS, *extra]:
        if each.name not in skip:
            each.add_to(parser, each.help_text(each.default_text(each.config_default())),
                        dest=f"{each.section}__{each.key}", default=None)


def add_flags(parser: Any, *names: str, command: str | None = None, defaults: dict[str, Any] | None = None,
              from_run: Iterable[str] = (), required: Iterable[str] = (), renamed: dict[str, str] | None = None
              ) -> None:
    """The flags `names` of `command` (a parser or a group of one). Each defaults to its definition's default,
    or to `defaults`' value (a required flag has none); a flag in `from_run` defaults to the run directory's
    value, else to the config's; `renamed` gives an old spelling that still works, with a note when used."""
    defaults, renamed = defaults or {}, renamed or {}
    for name in names:
        each = flag(name, command)
        options: dict[str, Any] = dict(required=True) if name in required else {}
        if name in from_run:
            default, text = None, f"the run's, else {each.default_text(each.config_default())}"
        elif options.get("required") or each.options.get("required"):
            default = text = None
        else:
            default = defaults.get(name, each.default)
            text = each.default_text(default)
        note, old = "", renamed.get(name)
        if old:
            note, options = f" ({old}: the old spelling)", {**options, "action": Renamed}
        if default is not None:
            options["default"] = default
        each.add_to(parser, each.help_text(text, note), *([old] if old else []), **options)


class Renamed(argparse.Action):
    """A flag with an old spelling that still works this version, with a note on stderr when it is used."""

    def __call__(self, parser, namespace, values, option_string=None):
        if option_string != self.option_strings[0]:
            print(f"{parser.prog}: note: {option_string} is deprecated, use {self.option_strings[0]}",
                  file=sys.stderr)
        setattr(namespace, self.dest, values)


def use_s3_endpoint(args: argparse.Namespace) -> None:
    """Apply --s3-endpoint: s3:// locations of this process and of the Dask workers it starts read
    AWS_ENDPOINT_URL_S3."""
    if args.s3_endpoint:
        os.environ["AWS_ENDPOINT_URL_S3"] = args.s3_endpoint


def data_flags(args: argparse.Namespace, base: Config) -> DataConfig:
    """The data section of a run's config (`base`) with the data flags given on top: --data, --dataset-split,
    --skip-unrenderable, --eval-fraction, --token-store and, where the command takes them, --seq-len,
    --eval-tokens and --max-samples."""
    data = base.data
    given = {key: getattr(args, key) for key in ("eval_tokens", "max_samples") if getattr(args, key, None) is not None}
    return replace(data, path=args.data or data.path, token_store=args.token_store or data.token_store,
                   dataset_split=args.dataset_split or data.dataset_split,
                   skip_unrenderable=args.skip_unrenderable or data.skip_unrenderable,
                   eval_fraction=data.eval_fraction if args.eval_fraction is None else args.eval_fraction,
                   seq_len=getattr(args, "seq_len", None) or data.seq_len, **given)


def config_overrides(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """The config keys the flags given set: {section: {key: value}}."""
    overrides: dict[str, dict[str, Any]] = {}
    for name, value in vars(args).items():
        if "__" in name and value is not None:
            section, key = name.split("__", 1)
            overrides.setdefault(section, {})[key] = value
    return overrides


def config_from_args(args: argparse.Namespace, path: str | None = None) -> Config:
    """Defaults, then the config file (`path`, or --config), then the flags given: validated, a bad value named by
    its flag or by its key in the file."""
    return load_config(path or args.config, config_overrides(args), flags=CONFIG_FLAGS)


def run_dir(args: argparse.Namespace) -> RunDir:
    """The run directory of a `bcd` or `train` command: its --out, or the default one."""
    from preinfer.run_dir import RunDir  # imports torch: `plan` and the command list load this module without it

    return RunDir(args.run__out or Config().run.out)


def config_for_command(args: argparse.Namespace) -> Config:
    """The config of a `bcd` or `train` run: with --resume the run's own config.toml, else --config; then
    the flags (with --resume, only those of RESUMABLE_KEYS may change it); refused before anything is opened."""
    run = run_dir(args)
    if args.resume:
        config = load_resumed(str(run.config), config_overrides(args), CONFIG_FLAGS, str(run.path))
    else:
        config = config_from_args(args)
    problem = device_problem(config.run.device)
    if problem:
        raise UsageError(f"[run] device = {config.run.device!r}: {problem}")
    _check_locations(config)
    return config


def _check_locations(config: Config) -> None:
    """Refuse a run directory that is not local, or a store location of a scheme stores cannot be written to,
    also when a config file gives it."""
    for where, value, check in (("[run] out", config.run.out, local_directory),
                                ("[store] path", config.store.path, store_location),
                                ("[pre_inference] store_dir", config.pre_inference.store_dir, store_location)):
        try:
            if value is not None:
                check(value)
        except argparse.ArgumentTypeError as err:
            raise UsageError(f"{where} = {value!r}: {err}") from None


def print_summary(summary: dict, config: Config) -> None:
    """Print the run's last line, on rank 0 only under torchrun (one rank reports)."""
    if int(os.environ.get("RANK", "0")) == 0:
        print(summary_line(summary, config))


def summary_line(summary: dict, config: Config) -> str:
    return (f"final eval loss {summary['final_eval_loss']:.4f} (ppl {summary['final_eval_ppl']:.2f}) after "
            f"{summary['steps']} steps, {summary['tokens']:,} tokens, {summary['wall_s']:.1f} s; "
            f"run in {config.run.out}")
