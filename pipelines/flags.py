"""Every flag of every `preinfer` command, defined once: its name, type, help and default, and for a training flag
the config field it sets (whose default `--help` shows). A command's `add_arguments` takes its flags by name:
`add_flags`, and `add_training_flags` for `bcd` and `train`. Torch-free at import, so that `preinfer plan` loads
without torch."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field, fields, replace
from typing import Any

from preinfer.block_order import ORDERS
from preinfer.config import (
    ATTENTIONS, DEFAULT_LR, DEFAULT_WEIGHT_DECAY, LR_DECAYS, STOP_RULES, TRACKERS, BlockConfig, Config, DataConfig,
    check_resume, load_config,
)
from preinfer.errors import UsageError
from preinfer.memory.settings import DTYPES, GPUS, USABLE_FRACTION, Settings
from preinfer.memory.traffic import COMPRESSION, STORE_DTYPES
from pipelines.flag_types import (
    device, device_problem, float_pair, local_directory, memory_size, non_negative_int, positive_float, positive_int,
    store_location, token_count, unit_fraction,
)

PARTITION_KEYS = ("ufp", "blocks", "ranges")

# The stopping rule of a visit when the config gives none.
DEFAULT_EPOCHS_PER_VISIT = 1.0


def shown(value: Any) -> str:
    """A default as --help writes it: floats without trailing zeros, lists as the flag takes them (0.9,0.95)."""
    if isinstance(value, list):
        return ",".join(shown(v) for v in value)
    if isinstance(value, bool):
        return "on" if value else "off"
    return f"{value:g}" if isinstance(value, float) else str(value)


@dataclass(frozen=True)
class Flag:
    """One flag: a training flag sets `[section] key` of the config, whose default its `--help` shows; any other
    flag has its own `default`. `unset` says what a default of None means, where --help should say it."""

    name: str  # --seq-len, or a positional's name
    section: str | None = None
    key: str | None = None
    help: str = ""
    options: dict[str, Any] = field(default_factory=dict)  # argparse keywords: type, choices, action, metavar
    unset: str | None = None
    default: Any = None  # the value of a flag that sets no config field, unless the command gives its own

    def config_default(self) -> Any:
        """The config dataclass's default."""
        return getattr(getattr(Config(), self.section), self.key)

    def default_text(self, value: Any) -> str | None:
        """A default as --help shows it: nothing for a switch that is off, `unset` for None."""
        if value is None or value is False:
            return self.unset
        return shown(value)

    def help_text(self, default: str | None, note: str = "") -> str:
        """The help, a note, then the default as [default]."""
        text = f"{self.help}{note}"
        return text if default is None else f"{text} [{default.replace('%', '%%')}]"

    def add_to(self, parser: Any, text: str, *names: str, **options: Any) -> None:
        """Add the flag with help `text` (under `names` too) to a parser or a group of one."""
        options = {**self.options, **options}
        if self.name.startswith("-") and "action" not in options and "choices" not in options:
            options.setdefault("metavar", self.name.lstrip("-").upper().replace("-", "_"))
        parser.add_argument(self.name, *names, help=text, **options)


def per_optimizer(defaults: dict[str, float]) -> str:
    """A per-optimizer default table as one phrase: 'sgd 0.1, adam 5e-05, adamw 5e-05'."""
    return ", ".join(f"{name} {shown(value)}" for name, value in defaults.items())


SWITCH = dict(action="store_const", const=True)
ON = dict(action="store_true")

CORPUS = ("a .txt, .jsonl (either also .gz or .zst), .parquet or .arrow file, a directory or quoted glob of them "
          "(a datasets save_to_disk folder or a local dataset repository too), or builtin:pydoc")
STORE = "a cache directory (all its splits) or a single store: a local path or s3://BUCKET/PATH"

TRAINING_FLAGS: list[Flag] = [
    Flag("--model", "model", "name", "a preset (tiny-gpt2, tiny-llama, small-llama, medium-llama, tiny-moe), a "
                                     "save_pretrained directory, or a run directory (its current weights)"),
    Flag("--tokenizer", "model", "tokenizer", "auto: the model directory's own tokenizer (the run's for a run "
                                              "directory, the byte tokenizer for a preset); 'byte' (built-in); or a "
                                              "local HF tokenizer directory"),
    Flag("--chat-template", "model", "chat_template", "a file whose Jinja chat template renders chat and instruction "
                                                      "data instead of the tokenizer's own", unset="the tokenizer's"),
    Flag("--attention", "model", "attention",
         "attention implementation: sdpa (PyTorch's scaled_dot_product_attention; on CUDA its flash and "
         "memory-efficient kernels, which keep no [T, T] attention probabilities for backward) or eager; the "
         "planner prices each, and a store records the one it was made with", dict(choices=list(ATTENTIONS))),
    Flag("--data", "data", "path", f"a corpus: {CORPUS}; or a token store written by preinfer tokenize"),
    Flag("--token-store", "data", "token_store", "where a corpus is tokenised once (one directory per corpus, "
                                                 "tokenizer and settings) and read lazily by every job",
         unset="$XDG_CACHE_HOME/preinfer/tokens"),
    Flag("--seq-len", "data", "seq_len", "tokens per sample", dict(type=positive_int)),
    Flag("--batch-size", "data", "batch_size", "samples per batch (in training, per micro-batch)",
         dict(type=positive_int)),
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
         "the memory each visit may fill, e.g. 22GiB, 512MiB, 24GB (10^9 bytes) or 1.5e9, instead of the GPU's "
         "usable memory: the automatic UFP (bcd --ufp auto, plan) is the fewest blocks that fit it",
         dict(type=memory_size, metavar="SIZE")),
    Flag("--gpu", "blocks", "gpu", f"with --ufp auto: the budget is this GPU's usable memory in the planner "
                                   f"({USABLE_FRACTION:.0%}% of its own, as `preinfer plan --gpu`)",
         dict(choices=list(GPUS))),
    Flag("--blocks", "blocks", "blocks", "number of blocks (instead of --ufp)", dict(type=positive_int)),
    Flag("--ranges", "blocks", "ranges", "explicit inclusive layer ranges, e.g. 0-3,4-7"),
    Flag("--separate-ends", "blocks", "separate_ends", "embedding and head form blocks of their own", SWITCH),
    Flag("--active", "blocks", "active",
         "train only this inclusive layer range as one block, e.g. 4-5; every other layer stays frozen"),
    Flag("--order", "blocks", "order", "block order within a sweep; importance: at each sweep's start, score every "
         "block by its gradient norm per parameter and visit those scoring at least the mean (and those "
         "--importance-floor makes due) in descending score; importance-cached: the same blocks in ascending order "
         "(stores rolled forward) unless their scores spread by more than --importance-margin",
         dict(choices=list(ORDERS))),
    Flag("--fixed-order", "blocks", "fixed_order", "block order for --order fixed, e.g. 2,0,1"),
    Flag("--start-block", "blocks", "start_block", "block each sweep begins with", dict(type=non_negative_int),
         unset="the order's first"),
    Flag("--sweeps", "blocks", "sweeps", "passes over all blocks", dict(type=positive_int)),
    Flag("--importance-batches", "blocks", "importance_batches", "importance orders: training batches (the first, "
         "in stored order) whose gradients score the blocks at each sweep's start", dict(type=positive_int)),
    Flag("--importance-floor", "blocks", "importance_floor", "importance orders: every block is visited at least "
         "once in any this many consecutive sweeps (1: every block every sweep, in score order)",
         dict(type=positive_int)),
    Flag("--importance-margin", "blocks", "importance_margin", "importance-cached: keep the ascending order unless "
         "the visited blocks' scores spread, (max - min) / max, by more than this", dict(type=float)),
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
    Flag("--warmup-steps", "optim", "warmup_steps", "linear warmup per visit (step 0 at 1/warmup of the rate)",
         dict(type=non_negative_int)),
    Flag("--warmup-ratio", "optim", "warmup_ratio", "instead of --warmup-steps: warmup over this share of each "
         "visit's steps, rounded up", dict(type=float)),
    Flag("--lr-decay", "optim", "decay", "the schedule after warmup, transformers.get_scheduler's by name (none: "
         "constant_with_warmup); linear and cosine fall to 0 at each visit's last step",
         dict(choices=list(LR_DECAYS))),
    Flag("--grad-clip", "optim", "grad_clip", "max gradient norm; 0 = off", dict(type=float)),
    Flag("--grad-accum", "optim", "grad_accum", "micro-batches per step", dict(type=positive_int)),
    Flag("--keep-optimizer-state", "optim", "keep_state",
         "keep each block's optimizer state between its visits (costs that state's memory for every block: 2x "
         "the model's weights for Adam) instead of dropping it after each visit", SWITCH),
    Flag("--steps-per-visit", "stop", "steps_per_visit", "step budget per visit", dict(type=positive_int)),
    Flag("--epochs-per-visit", "stop", "epochs_per_visit", "epoch budget per visit (one caching pass serves them "
         "all)", dict(type=positive_float),
         unset=f"{shown(DEFAULT_EPOCHS_PER_VISIT)} when no other stopping rule is given"),
    Flag("--patience", "stop", "patience", "plateau rule: steps without improvement", dict(type=positive_int)),
    Flag("--min-delta", "stop", "min_delta", "plateau rule: improvement that counts", dict(type=float)),
    Flag("--stop", "stop", "rule", "budget: a visit ends at its step or epoch budget or plateau; gain: also when its "
         "recent loss decrease per second falls below the best predicted for another block (its score over the "
         "active block's, times the active block's initial rate, less its switching cost); needs an importance "
         "order", dict(choices=list(STOP_RULES))),
    Flag("--gain-window", "stop", "gain_window", "gain rule: the loss decrease per second is taken over the last 2 x "
         "this many steps", dict(type=positive_int)),
    Flag("--total-steps", "stop", "total_steps", "the run's step budget: it ends once this many optimizer steps are "
         "done, the visit under way ending there (evaluated and recorded, stop reason total-steps), even mid-sweep; "
         "the run also ends after --sweeps", dict(type=positive_int)),
    Flag("--out", "run", "out", "run directory (local)", dict(type=local_directory)),
    Flag("--mode", "run", "mode", "bcd, or full-parameter training", dict(choices=["bcd", "full"])),
    Flag("--seed", "run", "seed", "seed of a preset's initialisation, and of a run's data and block "
         "order", dict(type=int)),
    Flag("--checkpoint-every", "run", "checkpoint_every", "steps between checkpoints; 0 = after every visit",
         dict(type=non_negative_int)),
    Flag("--device", "run", "device", "cpu, cuda, cuda:1 ...; with --dask local:N and a bare cuda, worker i takes GPU "
                                      "i mod the visible GPUs", dict(type=device)),
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
    Flag("--pipeline-schedule", "run", "pipeline_schedule", "pipeline schedule (torch.distributed.pipelining)",
         dict(choices=["1f1b", "gpipe"])),
    Flag("--report-to", "run", "report_to", f"experiment trackers the run's records go to (rank 0): a comma list of "
         f"{', '.join(TRACKERS)}, offline by default (event files, W&B offline, an MLflow file store in --out); "
         f"each needs its extra, pip install 'preinfer[tensorboard]'"),
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
    Flag("--store-format", "pre_inference", "store_format", "store format", dict(choices=["zarr", "safetensors"])),
    Flag("--store-dtype", "pre_inference", "store_dtype", "storage dtype of hidden states; auto = the compute dtype, "
         "bit-exact; float8_e4m3, float8_e5m2, int8: lossy 8-bit codes with a per-token scale, decoding error "
         "measured per shard",
         dict(choices=["auto", "float32", "bfloat16", "float16", "float8_e4m3", "float8_e5m2", "int8"])),
    Flag("--keep-stores", "pre_inference", "keep_stores", "keep stores that are no longer usable", SWITCH),
    Flag("--dask", "pre_inference", "dask",
         "build stores on Dask: local:N (a LocalCluster of N worker processes, one Dask thread and cores/N torch "
         "threads each) or tcp://HOST:PORT (an existing scheduler; not under torchrun)"),
]

# Flags of `train` only: the cache it trains from.
STORE_FLAGS: list[Flag] = [
    Flag("--store", "store", "path", "cache directory written by `preinfer cache` (its train and eval stores); "
                                     "its boundary K is where the trained suffix begins; a local path or "
                                     "s3://BUCKET/PATH", dict(metavar="CACHE", type=store_location)),
    Flag("--trust-store", "store", "trust", "use the store even if the model's weights below K differ from the "
                                            "ones it was made from", SWITCH),
]


# Flags of several commands that set no config field.
SHARED_FLAGS: list[Flag] = [
    Flag("--config", help="a TOML config file; flags override its values"),
    Flag("--resume", help="continue the run in --out from its last checkpoint with its own config.toml; flags may "
                          "change only --checkpoint-every, --device, --token-store, --dask and (to train on) --sweeps, "
                          "each recorded in metrics.jsonl", options=ON),
    Flag("--s3-endpoint", help="S3-compatible endpoint of s3:// stores, e.g. http://127.0.0.1:9000 (sets "
                               "AWS_ENDPOINT_URL_S3)", options=dict(metavar="URL"),
         unset="AWS_ENDPOINT_URL_S3 or AWS_ENDPOINT_URL, else AWS"),
    Flag("path", help=STORE, options=dict(metavar="STORE", type=store_location)),
    Flag("--quiet", help="no progress bar", options=ON),
    Flag("--json", help="print the result as JSON instead of text", options=ON),
]


def _prices() -> str:
    """The GPU table's prices as one phrase."""
    return ", ".join(f"{name} ${gpu['price']:.2f}" for name, gpu in GPUS.items() if gpu["price"] is not None)


# Flags of one command (its meaning of a name other commands use differently, too). Defaults that are a job's
# options (CacheOptions, TokenizeOptions) come from the command, which imports the job.
COMMAND_FLAGS: dict[str, list[Flag]] = {
    "cache": [
        Flag("--boundary", help="K in [1, layers]: store the input of layer K (embedding and layers [0, K) are run)",
             options=dict(type=int, required=True)),
        Flag("--out", help="cache directory: one store per split in OUT/<split>/ and an index OUT/cache.json; a "
                           "local path or s3://BUCKET/PATH", options=dict(type=store_location, required=True)),
        Flag("--splits", help="comma-separated splits to cache"),
        Flag("--from-store", help="roll forward: run only layers [K, --boundary) over the cache (or store) at "
                                  "boundary K", options=dict(metavar="STORE_K", type=store_location)),
        Flag("--codec", help="zarr codec: blosc-zstd, blosc-lz4, zstd, none", unset="blosc-zstd; none for safetensors"),
        Flag("--samples-per-shard", help="samples per shard (the unit of writing, resuming and Dask tasks)",
             options=dict(type=positive_int), unset="about 64 MiB of hidden states per shard, at least 1"),
        Flag("--workers", help="1: one process, writing overlapped with compute; N > 1 is --dask local:N",
             options=dict(type=positive_int), default=1),
        Flag("--retries", help="times a failed shard is retried before the job gives up on it",
             options=dict(type=non_negative_int)),
        Flag("--resume", help="compute only the shards missing from the store at --out (the default)", options=ON),
        Flag("--overwrite", help="replace a store with another fingerprint (or layout) at --out", options=ON),
    ],
    "eval": [
        Flag("--split", help="the split to evaluate", options=dict(choices=["eval", "train"]), default="eval"),
    ],
    "verify": [
        Flag("--sample", help="samples per store to recompute and compare, chosen at random",
             options=dict(type=non_negative_int), default=8),
        Flag("--seed", help="seed of the sample choice", options=dict(type=int), default=0),
        Flag("--model-seed", "run", "seed", "initialisation seed of a preset", dict(type=int)),
    ],
    "tokenize": [
        Flag("--data", help=f"the corpus to tokenise: {CORPUS}"),
        Flag("--text-column", help="the field (.jsonl) or column (.parquet) that holds LM text"),
        Flag("--out", help="the token store's directory: OUT/train/ and OUT/eval/ (zarr stores) and "
                           "OUT/token-store.json", options=dict(required=True)),
        Flag("--workers", help="processes that tokenise; the store is the same for any number",
             options=dict(type=positive_int)),
        Flag("--samples-per-shard", help="samples per shard (the unit of writing, resuming and reading)",
             options=dict(type=positive_int), unset="about 4 MiB of ids"),
        Flag("--overwrite", help="replace a token store of another corpus or setting at --out (a resumable, "
                                 "unfinished one too); without it, an interrupted run of the same command resumes",
             options=ON),
    ],
    "plan": [
        Flag("--model", help="a preset (tiny-llama, small-llama, ...), a local model directory, a config.json, or a "
                             "size: 1.5b, 7b, 13b, 20b (standard shapes)", options=dict(required=True)),
        Flag("--arch", help="shape family for a size given to --model", options=dict(choices=["llama", "gpt2"]),
             default="llama"),
        Flag("--gpu", help="GPU type: memory, peak FLOPs and default price", options=dict(choices=list(GPUS)),
             default=Settings.gpu),
        Flag("--gpu-mem", help="GPU memory in GB, overriding the --gpu table's",
             options=dict(type=positive_float, metavar="GB")),
        Flag("--micro-batch", help="sequences per micro-batch step", options=dict(type=positive_int),
             default=Settings.micro_batch),
        Flag("--ufp", help="unfrozen parameter fraction per visit, e.g. 1/3 or 0.25: ceil(1/UFP) blocks",
             options=dict(type=unit_fraction), default=BlockConfig.ufp),
        Flag("--dtype", help="float32; bf16-mixed (bf16 weights, 2 bytes/parameter; the trainable parameters' "
                             "float32 masters, gradients and Adam moments, 16 bytes more, as the trainer holds "
                             "them); bf16 (everything bf16)", options=dict(choices=list(DTYPES)),
             default=Settings.dtype),
        Flag("--recompute", help="activation recomputation for the BCD rows (the full-Adam row is shown both ways)",
             options=ON),
        Flag("--tokens", help="dataset / training token budget, e.g. 1e9: store size on disk, transfer times and "
                              "cost", options=dict(type=token_count)),
        Flag("--bandwidth-gbps", help="inter-GPU link bandwidth in Gbit/s for the traffic comparison",
             options=dict(type=positive_float), default=Settings.bandwidth_gbps),
        Flag("--pipeline", help="pipeline degree for the traffic comparison", options=dict(type=positive_int),
             unset="the plan's own, at least 2"),
        Flag("--store-dtype", help="storage dtype of boundary states; float8_e4m3, float8_e5m2, int8: 8-bit codes "
                                   "plus a float32 scale per token", options=dict(choices=list(STORE_DTYPES)),
             unset="float32 when training in float32, else bfloat16"),
        Flag("--compression", help="store codec ratio", options=dict(type=positive_float),
             unset=", ".join(f"{ratio:g} for {kind} stores" for kind, ratio in COMPRESSION.items())),
        Flag("--price-per-hour", help="GPU price per hour", options=dict(type=positive_float, metavar="USD"),
             unset=f"the paper's: {_prices()}"),
        Flag("--mfu", help="assumed model-FLOPs utilisation for the cost estimate", options=dict(type=unit_fraction),
             default=Settings.mfu),
    ],
    "demo": [
        Flag("--out", help="directory for the two run directories and demo.png; an earlier demo there is replaced",
             options=dict(type=local_directory), default="runs/demo"),
    ],
}

FLAGS: dict[str, Flag] = {flag.name: flag for flag in [*TRAINING_FLAGS, *PRE_INFERENCE_FLAGS, *STORE_FLAGS,
                                                       *SHARED_FLAGS]}


# The data flags of the commands that read a dataset beside a model (`cache`, `eval`, `verify`).
DATA_FLAGS = ("--data", "--tokenizer", "--eval-fraction", "--token-store")


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
    """The data section of a run's config (`base`) with the data flags given on top: --data, --eval-fraction,
    --token-store and, where the command takes it, --seq-len."""
    data = base.data
    return replace(data, path=args.data or data.path, token_store=args.token_store or data.token_store,
                   eval_fraction=data.eval_fraction if args.eval_fraction is None else args.eval_fraction,
                   seq_len=getattr(args, "seq_len", None) or data.seq_len)


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
    the flags (with --resume, only those of RESUMABLE_KEYS may change it); a visit with no stopping rule gets
    one epoch."""
    from preinfer.run_dir import RunDir  # imports torch: `plan` and the command list load this module without it

    run = RunDir(args.run__out or Config().run.out)
    path = str(run.config) if args.resume else None
    config = config_from_args(args, path=path)
    problem = device_problem(config.run.device)
    if problem:
        raise UsageError(f"[run] device = {config.run.device!r}: {problem}")
    _check_locations(config)
    stop = config.stop
    if stop.steps_per_visit is None and stop.epochs_per_visit is None and stop.patience is None:
        stop.epochs_per_visit = DEFAULT_EPOCHS_PER_VISIT
    if args.resume:
        check_resume(load_config(path), config, str(run.path))
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
