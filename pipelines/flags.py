"""The training flags shared by `bcd` and `train`: each maps to one field of the typed config, whose default
`--help` shows."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field
from typing import Any

from preinfer.config import Config, load_config
from preinfer.errors import UsageError
from preinfer.memory_model import GPUS, USABLE_FRACTION
from preinfer.run_dir import RunDir
from preinfer.optim import DEFAULT_LR, DEFAULT_WEIGHT_DECAY, LR_DECAYS
from pipelines.arguments import (
    device, device_problem, float_pair, local_directory, memory_size, non_negative_int, positive_float, positive_int,
    shown, store_location,
)

PARTITION_KEYS = ("ufp", "blocks", "ranges")

# The stopping rule of a visit when the config gives none.
DEFAULT_EPOCHS_PER_VISIT = 1.0


@dataclass(frozen=True)
class Flag:
    """A flag that sets `[section] key` of the config; `--help` appends the dataclass default, or `unset` (what
    the default None means) where given."""

    name: str
    section: str
    key: str
    help: str
    options: dict[str, Any] = field(default_factory=dict)  # argparse keywords: type, choices, action, metavar
    unset: str | None = None

    def default(self) -> Any:
        """The config dataclass's default."""
        return getattr(getattr(Config(), self.section), self.key)

    def default_text(self) -> str | None:
        """The default as --help shows it (nothing for a switch that is off)."""
        value = self.default()
        if value is None or value is False:
            return self.unset
        return shown(value)

    def help_text(self) -> str:
        """The help with the default appended."""
        default = self.default_text()
        return self.help if default is None else f"{self.help} [{default}]"


def per_optimizer(defaults: dict[str, float]) -> str:
    """A per-optimizer default table as one phrase: 'sgd 0.1, adam 5e-05, adamw 5e-05'."""
    return ", ".join(f"{name} {shown(value)}" for name, value in defaults.items())


SWITCH = dict(action="store_const", const=True)

TRAINING_FLAGS: list[Flag] = [
    Flag("--model", "model", "name", "preset (tiny-gpt2, tiny-llama, small-llama, medium-llama, tiny-moe), a "
                                     "save_pretrained directory, or a run directory"),
    Flag("--tokenizer", "model", "tokenizer", "auto: the model directory's own tokenizer (the run's for a run "
                                              "directory, the byte tokenizer for a preset); 'byte' (built-in); or a "
                                              "local HF tokenizer directory"),
    Flag("--chat-template", "model", "chat_template", "a file whose Jinja chat template renders chat and instruction "
                                                      "data instead of the tokenizer's own", unset="the tokenizer's"),
    Flag("--data", "data", "path", "a corpus: .txt, .jsonl (either also .gz or .zst) or .parquet file, a directory "
                                   "or quoted glob of them, or builtin:pydoc; or a token store written by "
                                   "preinfer tokenize"),
    Flag("--token-store", "data", "token_store", "where a corpus is tokenised once (one directory per corpus, "
                                                 "tokenizer and settings) and read lazily by every job",
         unset="$XDG_CACHE_HOME/preinfer/tokens"),
    Flag("--seq-len", "data", "seq_len", "tokens per sample", dict(type=positive_int)),
    Flag("--batch-size", "data", "batch_size", "samples per micro-batch", dict(type=positive_int)),
    Flag("--eval-fraction", "data", "eval_fraction", "share of documents held out", dict(type=float)),
    Flag("--eval-tokens", "data", "eval_tokens", "evaluate on the first samples of the eval split holding this many "
                                                 "tokens, the same every visit; 0 = the whole split",
         dict(type=non_negative_int)),
    Flag("--max-samples", "data", "max_samples", "use only the first N samples of each split; 0 = all",
         dict(type=non_negative_int)),
    Flag("--samples-per-shard", "data", "samples_per_shard",
         "samples per store shard, which also shapes the sample order; 0 = about 64 MiB of boundary states",
         dict(type=non_negative_int)),
    Flag("--ufp", "blocks", "ufp", "unfrozen parameter fraction per block, e.g. 1/3; auto: the fewest blocks whose "
                                   "every visit fits --memory-budget (or --gpu), by the planner of `preinfer plan`"),
    Flag("--memory-budget", "blocks", "memory_budget",
         "with --ufp auto: the memory each visit may fill, e.g. 22GiB, 512MiB, 24GB (10^9 bytes) or 1.5e9",
         dict(type=memory_size, metavar="SIZE")),
    Flag("--gpu", "blocks", "gpu", f"with --ufp auto: the budget is this GPU's usable memory in the planner "
                                   f"({USABLE_FRACTION:.0%}% of its own, as `preinfer plan --gpu`)",
         dict(choices=list(GPUS))),
    Flag("--blocks", "blocks", "blocks", "number of blocks (instead of --ufp)", dict(type=positive_int)),
    Flag("--ranges", "blocks", "ranges", "explicit inclusive layer ranges, e.g. 0-3,4-7"),
    Flag("--separate-ends", "blocks", "separate_ends", "embedding and head form blocks of their own", SWITCH),
    Flag("--active", "blocks", "active",
         "train only this inclusive layer range as one block, e.g. 4-5; every other layer stays frozen"),
    Flag("--order", "blocks", "order", "block order within a sweep",
         dict(choices=["ascending", "descending", "random", "fixed"])),
    Flag("--fixed-order", "blocks", "fixed_order", "block order for --order fixed, e.g. 2,0,1"),
    Flag("--start-block", "blocks", "start_block", "block each sweep begins with", dict(type=non_negative_int),
         unset="the order's first"),
    Flag("--sweeps", "blocks", "sweeps", "passes over all blocks", dict(type=positive_int)),
    Flag("--experts", "blocks", "experts", "expert-granular blocks (mixture of experts): top:SHARE trains, in each "
         "sparse layer of a block, the fewest experts carrying SHARE of its routed tokens (ESFT)"),
    Flag("--experts-with", "blocks", "experts_with", "what trains with the chosen experts: a comma list of router, "
         "shared, attention, rest (norms, dense MLPs, embedding, head), or none"),
    Flag("--experts-sample", "blocks", "experts_sample", "training batches whose routing picks the experts",
         dict(type=positive_int)),
    Flag("--optimizer", "optim", "name", "optimizer", dict(choices=list(DEFAULT_LR))),
    Flag("--lr", "optim", "lr", "learning rate", dict(type=positive_float), unset=per_optimizer(DEFAULT_LR)),
    Flag("--betas", "optim", "betas", "Adam betas", dict(type=float_pair)),
    Flag("--momentum", "optim", "momentum", "SGD momentum", dict(type=float)),
    Flag("--weight-decay", "optim", "weight_decay", "weight decay", dict(type=float),
         unset=per_optimizer(DEFAULT_WEIGHT_DECAY)),
    Flag("--warmup-steps", "optim", "warmup_steps", "linear warmup per visit", dict(type=non_negative_int)),
    Flag("--lr-decay", "optim", "decay", "after warmup, the rate falls to 0 at each visit's last step",
         dict(choices=list(LR_DECAYS))),
    Flag("--grad-clip", "optim", "grad_clip", "max gradient norm; 0 = off", dict(type=float)),
    Flag("--grad-accum", "optim", "grad_accum", "micro-batches per step", dict(type=positive_int)),
    Flag("--keep-optimizer-state", "optim", "keep_state",
         "keep each block's optimizer state between its visits (costs that state's memory for every block: 2x "
         "the model's weights for Adam) instead of dropping it after each visit", SWITCH),
    Flag("--steps-per-visit", "stop", "steps_per_visit", "step budget per visit", dict(type=positive_int)),
    Flag("--epochs-per-visit", "stop", "epochs_per_visit", "epoch budget per visit", dict(type=positive_float),
         unset=f"{shown(DEFAULT_EPOCHS_PER_VISIT)} when no other stopping rule is given"),
    Flag("--patience", "stop", "patience", "plateau rule: steps without improvement", dict(type=positive_int)),
    Flag("--min-delta", "stop", "min_delta", "plateau rule: improvement that counts", dict(type=float)),
    Flag("--out", "run", "out", "run directory (local)", dict(type=local_directory)),
    Flag("--mode", "run", "mode", "bcd, or full-parameter training", dict(choices=["bcd", "full"])),
    Flag("--seed", "run", "seed", "seed of initialisation, data order and block order", dict(type=int)),
    Flag("--checkpoint-every", "run", "checkpoint_every", "steps between checkpoints; 0 = after every visit",
         dict(type=non_negative_int)),
    Flag("--device", "run", "device", "cpu, cuda, cuda:1 ...", dict(type=device)),
    Flag("--precision", "run", "precision",
         "fp32, or every weight in 16 bits with fp32 masters, gradients and optimizer state for the active block "
         "only (fp16-mixed adds dynamic loss scaling); auto follows the model's weights",
         dict(choices=["auto", "fp32", "bf16-mixed", "fp16-mixed"])),
    Flag("--recompute", "run", "recompute",
         "activation checkpointing: every layer in the gradient path (the active block and the frozen layers "
         "above it) keeps only its input and runs its forward again in backward: less activation memory, a "
         "second forward of those layers", SWITCH),
    Flag("--pipeline", "run", "pipeline", "pipeline stages: under torchrun with N x D processes, D data-parallel "
         "replicas of an N-stage pipeline; each rank holds only its stage's layers", dict(type=positive_int)),
    Flag("--microbatches", "run", "microbatches", "micro-batches each --batch-size batch is split into on a "
         "pipeline; must divide it", dict(type=positive_int), unset="as many as --pipeline stages"),
    Flag("--schedule", "run", "schedule", "pipeline schedule (torch.distributed.pipelining)",
         dict(choices=["1f1b", "gpipe"])),
]

# Flags of `bcd` only: where visits above the input get their boundary states.
PRE_INFERENCE_FLAGS: list[Flag] = [
    Flag("--pre-inference", "pre_inference", "mode",
         "train blocks above the input from stores of boundary states: on; never: off; auto plans each sweep "
         "(stores built, rolled forward, read; peak disk) against running it live, with measured throughputs, and "
         "reads stores when they are predicted to save more than 2%%",
         dict(choices=["auto", "on", "off"])),
    Flag("--store-dir", "pre_inference", "store_dir", "where the run keeps its stores: a local path or "
         "s3://BUCKET/PATH", dict(type=store_location), unset="<out>/stores"),
    Flag("--store-format", "pre_inference", "store_format", "store backend", dict(choices=["zarr", "safetensors"])),
    Flag("--store-dtype", "pre_inference", "store_dtype", "storage dtype; auto = the compute dtype, bit-exact; "
         "float8_e4m3, float8_e5m2, int8: lossy 8-bit with a per-token scale (error measured per shard)",
         dict(choices=["auto", "float32", "bfloat16", "float16", "float8_e4m3", "float8_e5m2", "int8"])),
    Flag("--keep-stores", "pre_inference", "keep_stores", "keep stores that are no longer usable", SWITCH),
    Flag("--dask", "pre_inference", "dask",
         "build stores on Dask: local:N (N worker processes) or tcp://HOST:PORT (not under torchrun)"),
]

# Flags of `train` only: the cache it trains from.
STORE_FLAGS: list[Flag] = [
    Flag("--store", "store", "path", "cache directory written by `preinfer cache` (its train and eval stores); "
                                     "its boundary K is where the trained suffix begins; a local path or "
                                     "s3://BUCKET/PATH", dict(metavar="CACHE", type=store_location)),
    Flag("--trust-store", "store", "trust", "use the store even if the model's weights below K differ from the "
                                            "ones it was made from", SWITCH),
]


def add_training_flags(parser: argparse.ArgumentParser, extra: list[Flag] = (), skip: tuple[str, ...] = ()) -> None:
    """Every training flag and `extra`, defaulting to None so that the config file and the defaults show
    through."""
    parser.add_argument("--config", help="a TOML config file; flags override its values")
    for flag in [*TRAINING_FLAGS, *extra]:
        if flag.name not in skip:
            options = flag.options
            if "action" not in options and "choices" not in options:
                options = {"metavar": flag.name.lstrip("-").upper().replace("-", "_"), **options}
            parser.add_argument(flag.name, dest=f"{flag.section}__{flag.key}", default=None,
                                help=flag.help_text(), **options)


def config_from_args(args: argparse.Namespace, path: str | None = None) -> Config:
    """Defaults, then the config file (`path`, or --config), then the flags given."""
    overrides: dict[str, dict[str, Any]] = {}
    for name, value in vars(args).items():
        if "__" in name and value is not None:
            section, key = name.split("__", 1)
            overrides.setdefault(section, {})[key] = value
    chosen = [k for k in PARTITION_KEYS if k in overrides.get("blocks", {})]
    if len(chosen) > 1:
        raise UsageError(f"give only one of --ufp, --blocks, --ranges (got {', '.join('--' + k for k in chosen)})")
    config = load_config(path or args.config, overrides)
    if chosen:
        for key in PARTITION_KEYS:
            if key != chosen[0]:
                setattr(config.blocks, key, None)
    return config


def config_for_command(args: argparse.Namespace) -> Config:
    """The config of a `bcd` or `train` run: with --resume the run's own config.toml, else --config; then
    the flags; a visit with no stopping rule gets one epoch."""
    path = str(RunDir(args.run__out or Config().run.out).config) if args.resume else None
    config = config_from_args(args, path=path)
    problem = device_problem(config.run.device)
    if problem:
        raise UsageError(f"[run] device = {config.run.device!r}: {problem}")
    _check_locations(config)
    stop = config.stop
    if stop.steps_per_visit is None and stop.epochs_per_visit is None and stop.patience is None:
        stop.epochs_per_visit = DEFAULT_EPOCHS_PER_VISIT
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
