"""The training flags shared by `bcd` and `train`: each maps to one field of the typed config."""

from __future__ import annotations

import argparse
from typing import Any

from preinfer.config import Config, load_config
from preinfer.errors import UsageError
from preinfer.run_dir import RunDir

PARTITION_KEYS = ("ufp", "blocks", "ranges")


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text}")
    return value


def non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text}")
    return value


def positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text}")
    return value


def float_pair(text: str) -> list[float]:
    parts = text.split(",")
    if len(parts) != 2:
        raise argparse.ArgumentTypeError(f"expected two numbers such as 0.9,0.95, got {text}")
    return [float(p) for p in parts]


# (flag, section, key, argparse keywords)
TRAINING_FLAGS: list[tuple[str, str, str, dict[str, Any]]] = [
    ("--model", "model", "name", dict(help="preset (tiny-gpt2, tiny-llama, small-llama, medium-llama), a "
                                           "save_pretrained directory, or a run directory [small-llama]")),
    ("--tokenizer", "model", "tokenizer", dict(help="'byte' (built-in) or a local HF tokenizer directory [byte]")),
    ("--data", "data", "path", dict(help="a .txt or .jsonl file (text or instruction records), a directory of "
                                         "them, or builtin:pydoc [builtin:pydoc]")),
    ("--seq-len", "data", "seq_len", dict(type=positive_int, help="tokens per sample [128]")),
    ("--batch-size", "data", "batch_size", dict(type=positive_int, help="samples per micro-batch [8]")),
    ("--eval-fraction", "data", "eval_fraction", dict(type=float, help="share of documents held out [0.1]")),
    ("--eval-batches", "data", "eval_batches", dict(type=non_negative_int, help="cap on eval batches; 0 = all [0]")),
    ("--max-samples", "data", "max_samples",
     dict(type=non_negative_int, help="use only the first N samples of each split; 0 = all [0]")),
    ("--samples-per-shard", "data", "samples_per_shard",
     dict(type=non_negative_int, help="samples per store shard, which also shapes the sample order; "
                                      "0 = about 64 MiB of boundary states [0]")),
    ("--ufp", "blocks", "ufp", dict(help="unfrozen parameter fraction per block, e.g. 1/3 [1/3]")),
    ("--blocks", "blocks", "blocks", dict(type=positive_int, help="number of blocks (instead of --ufp)")),
    ("--ranges", "blocks", "ranges", dict(help="explicit inclusive layer ranges, e.g. 0-3,4-7")),
    ("--separate-ends", "blocks", "separate_ends",
     dict(action="store_const", const=True, help="embedding and head form blocks of their own")),
    ("--active", "blocks", "active",
     dict(help="train only this inclusive layer range as one block, e.g. 4-5; every other layer stays frozen")),
    ("--order", "blocks", "order", dict(choices=["ascending", "descending", "random", "fixed"],
                                        help="block order within a sweep [ascending]")),
    ("--fixed-order", "blocks", "fixed_order", dict(help="block order for --order fixed, e.g. 2,0,1")),
    ("--start-block", "blocks", "start_block", dict(type=non_negative_int, help="block each sweep begins with [the order's first]")),
    ("--sweeps", "blocks", "sweeps", dict(type=positive_int, help="passes over all blocks [1]")),
    ("--optimizer", "optim", "name", dict(choices=["adam", "adamw", "sgd"], help="[adam]")),
    ("--lr", "optim", "lr", dict(type=positive_float, help="learning rate [sgd 0.1, adam/adamw 5e-5]")),
    ("--betas", "optim", "betas", dict(type=float_pair, help="Adam betas [0.9,0.95]")),
    ("--momentum", "optim", "momentum", dict(type=float, help="SGD momentum [0.9]")),
    ("--weight-decay", "optim", "weight_decay", dict(type=float, help="[sgd 1e-5, adam 0, adamw 0.01]")),
    ("--warmup-steps", "optim", "warmup_steps", dict(type=non_negative_int, help="linear warmup per visit [0]")),
    ("--grad-clip", "optim", "grad_clip", dict(type=float, help="max gradient norm; 0 = off [0]")),
    ("--grad-accum", "optim", "grad_accum", dict(type=positive_int, help="micro-batches per step [1]")),
    ("--keep-optimizer-state", "optim", "keep_state",
     dict(action="store_const", const=True,
          help="keep each block's optimizer state between its visits (costs that state's memory for every "
               "block: 2x the model's weights for Adam) instead of dropping it after each visit")),
    ("--steps-per-visit", "stop", "steps_per_visit", dict(type=positive_int, help="step budget per visit")),
    ("--epochs-per-visit", "stop", "epochs_per_visit", dict(type=positive_float, help="epoch budget per visit")),
    ("--patience", "stop", "patience", dict(type=positive_int, help="plateau rule: steps without improvement")),
    ("--min-delta", "stop", "min_delta", dict(type=float, help="plateau rule: improvement that counts [0]")),
    ("--out", "run", "out", dict(help="run directory [runs/bcd]")),
    ("--mode", "run", "mode", dict(choices=["bcd", "full"], help="bcd, or full-parameter training [bcd]")),
    ("--seed", "run", "seed", dict(type=int, help="seed of initialisation, data order and block order [0]")),
    ("--checkpoint-every", "run", "checkpoint_every",
     dict(type=non_negative_int, help="steps between checkpoints; 0 = after every visit [0]")),
    ("--device", "run", "device", dict(help="cpu, cuda, cuda:1 ... [cpu]")),
    ("--precision", "run", "precision",
     dict(choices=["auto", "fp32", "bf16-mixed", "fp16-mixed"],
          help="fp32, or every weight in 16 bits with fp32 masters, gradients and optimizer state for the "
               "active block only (fp16-mixed adds dynamic loss scaling); auto follows the model's weights [auto]")),
    ("--recompute", "run", "recompute",
     dict(action="store_const", const=True,
          help="activation checkpointing: every layer in the gradient path (the active block and the frozen "
               "layers above it) keeps only its input and runs its forward again in backward: less "
               "activation memory, a second forward of those layers [off]")),
]

# Flags of `bcd` only: where visits above the input get their boundary states.
PRE_INFERENCE_FLAGS: list[tuple[str, str, str, dict[str, Any]]] = [
    ("--pre-inference", "run", "pre_inference",
     dict(choices=["auto", "on", "off"],
          help="train blocks above the input from stores of boundary states: on; never: off; auto decides per "
               "visit by a cost model (store build + reads against the prefix compute saved) [auto]")),
    ("--store-dir", "run", "store_dir", dict(help="where the run keeps its stores [<out>/stores]")),
    ("--store-format", "run", "store_format", dict(choices=["zarr", "safetensors"], help="[zarr]")),
    ("--store-dtype", "run", "store_dtype", dict(choices=["auto", "float32", "bfloat16", "float16"],
                                                 help="auto = the compute dtype, bit-exact [auto]")),
    ("--keep-stores", "run", "keep_stores",
     dict(action="store_const", const=True, help="keep stores that are no longer usable")),
    ("--dask", "run", "dask", dict(help="build stores on Dask: local:N (N worker processes) or tcp://HOST:PORT")),
]


def add_training_flags(parser: argparse.ArgumentParser, skip: tuple[str, ...] = (), pre_inference: bool = False) -> None:
    """Every training flag, defaulting to None so that the config file and the defaults show through."""
    parser.add_argument("--config", help="a TOML config file; flags override its values")
    for flag, section, key, kwargs in TRAINING_FLAGS + (PRE_INFERENCE_FLAGS if pre_inference else []):
        if flag not in skip:
            if "action" not in kwargs and "choices" not in kwargs:
                kwargs = {"metavar": flag.lstrip("-").upper().replace("-", "_"), **kwargs}
            parser.add_argument(flag, dest=f"{section}__{key}", default=None, **kwargs)


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
    stop = config.stop
    if stop.steps_per_visit is None and stop.epochs_per_visit is None and stop.patience is None:
        stop.epochs_per_visit = 1.0
    return config


def summary_line(summary: dict, config: Config) -> str:
    return (f"final eval loss {summary['final_eval_loss']:.4f} (ppl {summary['final_eval_ppl']:.2f}) after "
            f"{summary['steps']} steps, {summary['tokens']:,} tokens, {summary['wall_s']:.1f} s; "
            f"run in {config.run.out}")
