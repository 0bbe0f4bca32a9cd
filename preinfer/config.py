"""The run configuration: one typed dataclass per section, loaded from TOML, overridden by flags."""

from __future__ import annotations

import math
import tomllib
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields, is_dataclass
from pathlib import Path
from types import UnionType
from typing import Any, get_args, get_type_hints

from preinfer.errors import PreinferError, UsageError
from preinfer.sizes import parse_size


# Attention implementations a model runs with (transformers' names): PyTorch's scaled_dot_product_attention
# (flash and memory-efficient kernels where the device has them), or the framework's eager matmul-softmax-matmul.
ATTENTIONS = ("sdpa", "eager")
DEFAULT_ATTENTION = "sdpa"


def check_attention(attention: str, where: str = "--attention") -> str:
    """`attention` if it is one of ATTENTIONS, else a one-line UsageError naming `where`."""
    if attention not in ATTENTIONS:
        raise UsageError(f"{where} {attention!r}: expected {' or '.join(ATTENTIONS)}")
    return attention


@dataclass
class ModelConfig:
    name: str = "small-llama"  # a preset, a save_pretrained directory, or a run directory
    tokenizer: str = "auto"  # auto (the model's own; byte for a preset), byte, or a local HF tokenizer directory
    chat_template: str | None = None  # a file whose Jinja chat template replaces the tokenizer's own
    attention: str = DEFAULT_ATTENTION  # sdpa or eager: the attention implementation every job runs the model with


@dataclass
class DataConfig:
    path: str = "builtin:pydoc"  # a corpus (file, directory, glob or builtin:pydoc) or a `preinfer tokenize` output
    seq_len: int = 128  # tokens per sample
    batch_size: int = 8  # samples per micro-batch
    eval_fraction: float = 0.1  # share of documents held out for evaluation
    eval_tokens: int = 262144  # evaluate on the eval split's first samples holding this many tokens; 0: all
    token_store: str | None = None  # where corpora are tokenised once and kept; None: $XDG_CACHE_HOME/preinfer/tokens
    max_samples: int = 0  # use only the first N samples of each split; 0: all
    samples_per_shard: int = 0  # shard size of stores, which also shapes the sample order; 0: ~64 MiB of states


@dataclass
class BlockConfig:
    ufp: str | None = "1/3"  # unfrozen parameter fraction per block ("auto": the fewest blocks that fit the budget)
    # with ufp = "auto": bytes a visit may fill; the config file may write a size, e.g. "22GiB" or 1.5e9
    memory_budget: int | None = field(default=None, metadata={"parse": parse_size})
    gpu: str | None = None  # with ufp = "auto": the budget is this GPU's usable memory in the planner (4090, ...)
    blocks: int | None = None  # number of blocks (instead of ufp)
    ranges: str | None = None  # explicit inclusive layer ranges, e.g. "0-3,4-7" (instead of ufp)
    separate_ends: bool = False  # embedding and head as blocks of their own
    order: str = "ascending"  # ascending, descending, random, fixed, importance, importance-cached
    fixed_order: str | None = None  # e.g. "2,0,1" with order = "fixed"
    start_block: int | None = None  # the block every sweep begins with; None: the order's own first block
    sweeps: int = 1  # passes over all blocks
    importance_batches: int = 2  # importance orders: training batches whose gradients score the blocks
    importance_floor: int = 2  # importance orders: every block is visited at least once in this many sweeps
    importance_margin: float = 0.25  # importance-cached: ascending unless the scores spread by more than this
    active: str | None = None  # train only this inclusive layer range, e.g. "4-5"; the other blocks stay frozen
    experts: str | None = None  # "top:0.5": in sparse layers train only the experts carrying that share of tokens
    experts_with: str = "router,shared,attention,rest"  # what trains with the chosen experts ("none": nothing)
    experts_sample: int = 8  # training batches whose routing picks the experts


# The reference paper's defaults of the optimizers, and the learning-rate decays after warmup.
DEFAULT_LR = {"sgd": 0.1, "adam": 5e-5, "adamw": 5e-5}
DEFAULT_WEIGHT_DECAY = {"sgd": 1e-5, "adam": 0.0, "adamw": 0.01}
# transformers' schedules by name (get_scheduler) that need no options of their own; "none" is constant_with_warmup.
LR_DECAYS = ("none", "linear", "cosine", "cosine_with_restarts", "polynomial", "constant_with_warmup", "inverse_sqrt")


@dataclass
class OptimConfig:
    name: str = "adam"  # adam, adamw, sgd
    lr: float | None = None  # None: the paper's default (sgd 0.1, adam/adamw 5e-5)
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    momentum: float = 0.9  # sgd only
    weight_decay: float | None = None  # None: sgd 1e-5, adam 0, adamw 0.01
    warmup_steps: int = 0  # linear warmup at the start of every visit (step 0 at 1/warmup of the rate)
    warmup_ratio: float = 0.0  # instead of warmup_steps: this share of each visit's steps, rounded up
    decay: str = "none"  # a transformers schedule after warmup: none, linear, cosine (to 0 at the visit's last step)...
    grad_clip: float = 0.0  # max gradient norm of the active block; 0 disables
    grad_accum: int = 1  # micro-batches per optimizer step
    keep_state: bool = False  # keep each block's optimizer state between its visits (costs its memory)


# A visit's stopping rules: its budgets (steps, epochs, plateau), or those and the gain rule (preinfer.gain).
STOP_RULES = ("budget", "gain")


@dataclass
class StopConfig:
    steps_per_visit: int | None = None  # optimizer steps per visit
    epochs_per_visit: float | None = None  # passes over the training split per visit (1 when no rule is set)
    patience: int | None = None  # plateau: smoothed loss not improved by min_delta for this many steps
    min_delta: float = 0.0  # plateau: the smallest improvement that counts
    smoothing: float = 0.9  # exponential smoothing of the training loss for the plateau rule
    rule: str = "budget"  # budget (steps, epochs, plateau) or gain: also end a visit when another block gains more
    gain_window: int = 4  # gain: the loss decrease per second is taken over the last 2 x this many steps
    total_steps: int | None = None  # the run's step budget: it ends once this many steps are done, whatever sweep


@dataclass
class RunConfig:
    out: str = "runs/bcd"  # the run directory (local)
    mode: str = "bcd"  # bcd, or full (full-parameter baseline: one block)
    seed: int = 0  # seeds a preset's initialisation, the sample order and the run's random state
    checkpoint_every: int = 0  # optimizer steps between checkpoints; 0: after every visit only
    device: str = "cpu"  # cpu, cuda, cuda:1, ...
    precision: str = "auto"  # fp32, bf16-mixed, fp16-mixed; auto follows the model's weights (bf16 -> bf16-mixed)
    recompute: bool = False  # keep one hidden state per layer in the gradient path; run the layer again in backward
    pipeline: int = 1  # pipeline stages (under torchrun: world size = pipeline x data-parallel replicas)
    microbatches: int = 0  # micro-batches per step through the pipeline; 0: as many as stages
    pipeline_schedule: str = "1f1b"  # 1f1b or gpipe
    report_to: str = "none"  # experiment trackers, a comma list of tensorboard, wandb, mlflow (rank 0 reports)


@dataclass
class PreInferenceConfig:
    """How `bcd` feeds visits above the input: from stores of boundary states it builds, or live."""

    mode: str = "auto"  # off, on, auto: train blocks above the input from stores of boundary states
    store_dir: str | None = None  # where bcd keeps its stores; None: <out>/stores
    store_format: str = "zarr"  # zarr or safetensors
    store_dtype: str = "auto"  # auto (the compute dtype, bit-exact), float32, bfloat16, float16
    keep_stores: bool = False  # keep stores that are no longer usable
    dask: str | None = None  # build stores on a Dask cluster: local:N or tcp://host:port


@dataclass
class StoreConfig:
    """The cache `preinfer train` trains from."""

    path: str | None = None  # a cache directory written by `preinfer cache`
    trust: bool = False  # use the store even if the model's prefix differs from the one it was made from


# The experiment trackers `report_to` may name (pipelines.training.trackers).
TRACKERS = ("tensorboard", "wandb", "mlflow")


# Keys of [run] in configs written before it was split, or renamed since: (section, key) they moved to.
MOVED_RUN_KEYS = {
    "pre_inference": ("pre_inference", "mode"),
    "store_dir": ("pre_inference", "store_dir"),
    "store_format": ("pre_inference", "store_format"),
    "store_dtype": ("pre_inference", "store_dtype"),
    "keep_stores": ("pre_inference", "keep_stores"),
    "dask": ("pre_inference", "dask"),
    "schedule": ("run", "pipeline_schedule"),
    "store": ("store", "path"),
    "trust_store": ("store", "trust"),
}


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    blocks: BlockConfig = field(default_factory=BlockConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    stop: StopConfig = field(default_factory=StopConfig)
    run: RunConfig = field(default_factory=RunConfig)
    pre_inference: PreInferenceConfig = field(default_factory=PreInferenceConfig)
    store: StoreConfig = field(default_factory=StoreConfig)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return asdict(self)


def load_config(path: str | Path | None = None, overrides: dict[str, dict[str, Any]] | None = None) -> Config:
    """Defaults, then the TOML file's values, then `overrides` ({section: {key: value}}, None values skipped)."""
    config = Config()
    if path is not None:
        _apply(config, _read_toml(Path(path)), source=str(path))
    _apply(config, overrides or {}, source="flags")
    check_values(config)
    check_attention(config.model.attention, f"{path or 'flags'}: [model] attention =")
    return config


def check_values(config: Config) -> None:
    """Refuse optimizer and stopping values that are not finite or out of range, naming the flag."""
    o, s, b = config.optim, config.stop, config.blocks
    checks = [
        ("optim", "betas", "--betas", len(o.betas) == 2 and all(0 <= b < 1 for b in o.betas), "two numbers in [0, 1)"),
        ("optim", "lr", "--lr", o.lr is None or 0 < o.lr < math.inf, "a finite number above 0"),
        ("optim", "momentum", "--momentum", 0 <= o.momentum < math.inf, "a finite number >= 0"),
        ("optim", "weight_decay", "--weight-decay", o.weight_decay is None or 0 <= o.weight_decay < math.inf,
         "a finite number >= 0"),
        ("optim", "warmup_ratio", "--warmup-ratio", 0 <= o.warmup_ratio < 1, "a number in [0, 1)"),
        ("optim", "warmup_ratio", "--warmup-ratio", not (o.warmup_ratio and o.warmup_steps),
         "0 when --warmup-steps is given (one of the two)"),
        ("optim", "grad_clip", "--grad-clip", 0 <= o.grad_clip < math.inf, "a finite number >= 0 (0 = off)"),
        ("run", "report_to", "--report-to", set(report_names(config.run.report_to)) <= {"none", *TRACKERS},
         f"a comma list of none, {', '.join(TRACKERS)}"),
        ("stop", "min_delta", "--min-delta", 0 <= s.min_delta < math.inf, "a finite number >= 0"),
        ("stop", "smoothing", "[stop] smoothing", 0 <= s.smoothing < 1, "a number in [0, 1)"),
        ("stop", "rule", "--stop", s.rule in STOP_RULES, f"one of {', '.join(STOP_RULES)}"),
        ("stop", "gain_window", "--gain-window", s.gain_window >= 1, "an integer >= 1"),
        ("blocks", "importance_batches", "--importance-batches", b.importance_batches >= 1, "an integer >= 1"),
        ("blocks", "importance_floor", "--importance-floor", b.importance_floor >= 1, "an integer >= 1"),
        ("blocks", "importance_margin", "--importance-margin", 0 <= b.importance_margin < math.inf,
         "a finite number >= 0"),
    ]
    for section, key, flag, ok, expected in checks:
        if not ok:
            value = getattr(getattr(config, section), key)
            shown = ",".join(map(str, value)) if isinstance(value, list) else value
            raise UsageError(f"{flag} {shown} ([{section}] {key}): expected {expected}")


def report_names(report_to: str) -> list[str]:
    """The names in a `run.report_to` value."""
    return [name.strip() for name in report_to.split(",") if name.strip()]


# Config keys a resumed run may change: where and how it runs, not what it trains, the number of sweeps (a run
# resumed for more sweeps ends as one run of that many) and the step budget (a raised one continues at the next
# visit; the visit it cut stays cut). Each change is recorded in metrics.jsonl as a `resume` record; a change of any
# other key refuses --resume.
RESUMABLE_KEYS = ("run.checkpoint_every", "run.device", "run.report_to", "data.token_store", "pre_inference.dask",
                  "blocks.sweeps", "stop.total_steps")
# The block partition: the first of these that is set wins (ranges, then blocks, then ufp).
PARTITION_ORDER = ("ranges", "blocks", "ufp")


def resume_changes(saved: Config, asked: Config) -> dict[str, list[Any]]:
    """{"section.key": [saved value, asked value]} for every config key in which `asked` differs from the run's
    saved config; the run directory's own path is not compared (it may have moved), the partition by the choice
    that wins."""
    before, after = _comparable(saved), _comparable(asked)
    return {key: [before[key], after[key]] for key in before if before[key] != after[key] and key != "run.out"}


def check_resume(saved: Config, asked: Config, where: str) -> dict[str, list[Any]]:
    """The changes of `resume_changes` when every one is in RESUMABLE_KEYS; else refuse, listing the others."""
    changes = resume_changes(saved, asked)
    refused = [f"[{key.replace('.', '] ', 1)} {changes[key][0]!r} -> {changes[key][1]!r}"
               for key in changes if key not in RESUMABLE_KEYS]
    if refused:
        allowed = ", ".join(f"[{key.replace('.', '] ', 1)}" for key in RESUMABLE_KEYS)
        raise UsageError(f"--resume continues the run in {where} as configured, but the flags change "
                         f"{'; '.join(refused)}; drop them (only {allowed} may change) or start a new run in "
                         f"another --out")
    return changes


def _comparable(config: Config) -> dict[str, Any]:
    values = {f"{section}.{key}": value for section, entries in config.to_dict().items()
              for key, value in entries.items()}
    chosen = next((key for key in PARTITION_ORDER if values[f"blocks.{key}"] is not None), None)
    for key in PARTITION_ORDER:
        if key != chosen:
            values[f"blocks.{key}"] = None
    return values


def _read_toml(path: Path) -> dict:
    if path.exists() and not path.is_file():  # a directory, or a fifo that would block the read
        raise UsageError(f"config file {path} is not a file")
    try:
        with path.open("rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise UsageError(f"config file {path} does not exist") from None
    except tomllib.TOMLDecodeError as err:
        raise UsageError(f"config file {path} is not valid TOML: {err}") from None
    except OSError as err:
        raise UsageError(f"config file {path}: cannot read it ({err.strerror or err})") from None


def _apply(config: Config, values: dict, source: str) -> None:
    for section, entries in values.items():
        target = getattr(config, section, None)
        if not is_dataclass(target) or not isinstance(entries, dict):
            raise UsageError(f"{source}: unknown config section [{section}]")
        hints = get_type_hints(type(target))
        parsers = {f.name: f.metadata["parse"] for f in fields(target) if "parse" in f.metadata}
        for key, value in entries.items():
            if section == "data" and key == "eval_batches":
                raise UsageError(f"{source}: [data] eval_batches is gone: write eval_tokens (tokens evaluated; 0: all)")
            if section == "run" and key in MOVED_RUN_KEYS:
                new_section, new_key = MOVED_RUN_KEYS[key]
                raise UsageError(f"{source}: [run] {key} has moved: write it as {new_key} in [{new_section}]")
            if key not in hints:
                raise UsageError(f"{source}: unknown key '{key}' in [{section}]")
            if value is not None:
                where = f"{source}: [{section}] {key}"
                parsed = _parse(value, parsers[key], where) if key in parsers else _coerce(value, hints[key], where)
                setattr(target, key, parsed)


def _parse(value: Any, parse: Callable[[Any], Any], where: str) -> Any:
    """A value written as text (a size) in the form the config holds (bytes)."""
    try:
        return parse(value)
    except UsageError as error:
        raise UsageError(f"{where} = {value!r}: {error}") from None


def _coerce(value: Any, hint: Any, where: str) -> Any:
    """Check a TOML value against the field's type; ints are accepted for floats."""
    allowed = get_args(hint) if isinstance(hint, UnionType) else (hint,)
    for kind in allowed:
        base = getattr(kind, "__origin__", kind)
        if base is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if base is int and isinstance(value, int) and not isinstance(value, bool):
            return value
        if base in (str, bool, list) and isinstance(value, base):
            return value
    names = " or ".join(getattr(k, "__name__", str(k)) for k in allowed if k is not type(None))
    raise UsageError(f"{where} = {value!r}: expected {names}")


def dump_toml(config: Config) -> str:
    """The fully resolved config as TOML (None values are left out: they mean 'default')."""
    lines = []
    for section in fields(config):
        lines.append(f"[{section.name}]")
        for key, value in asdict(getattr(config, section.name)).items():
            if value is not None:
                lines.append(f"{key} = {_toml_value(value)}")
        lines.append("")
    return "\n".join(lines)


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise PreinferError(f"cannot write {value!r} as TOML")
