"""The run configuration: one typed dataclass per section, loaded from TOML, overridden by flags."""

from __future__ import annotations

import tomllib
from dataclasses import asdict, dataclass, field, fields, is_dataclass
from pathlib import Path
from types import UnionType
from typing import Any, get_args, get_type_hints

from preinfer.errors import UsageError


@dataclass
class ModelConfig:
    name: str = "small-llama"  # a preset, a save_pretrained directory, or a run directory
    tokenizer: str = "auto"  # auto (the model's own; byte for a preset), byte, or a local HF tokenizer directory
    chat_template: str | None = None  # a file whose Jinja chat template replaces the tokenizer's own


@dataclass
class DataConfig:
    path: str = "builtin:pydoc"  # a corpus (file, directory, glob or builtin:pydoc) or a `preinfer tokenize` output
    seq_len: int = 128
    batch_size: int = 8
    eval_fraction: float = 0.1
    eval_tokens: int = 262144  # evaluate on the eval split's first samples holding this many tokens; 0: all
    token_store: str | None = None  # where corpora are tokenised once and kept; None: $XDG_CACHE_HOME/preinfer/tokens
    max_samples: int = 0  # use only the first N samples of each split; 0: all
    samples_per_shard: int = 0  # shard size of stores, which also shapes the sample order; 0: ~64 MiB of states


@dataclass
class BlockConfig:
    ufp: str | None = "1/3"  # unfrozen parameter fraction per block ("auto": the fewest blocks that fit the budget)
    memory_budget: int | float | str | None = None  # with ufp = "auto": bytes a visit may fill, e.g. "22GiB", 1.5e9
    gpu: str | None = None  # with ufp = "auto": the budget is this GPU's usable memory in the planner (4090, ...)
    blocks: int | None = None
    ranges: str | None = None
    separate_ends: bool = False  # embedding and head as blocks of their own
    order: str = "ascending"  # ascending, descending, random, fixed
    fixed_order: str | None = None  # e.g. "2,0,1" with order = "fixed"
    start_block: int | None = None  # the block every sweep begins with; None: the order's own first block
    sweeps: int = 1
    active: str | None = None  # train only this inclusive layer range, e.g. "4-5"; the other blocks stay frozen
    experts: str | None = None  # "top:0.5": in sparse layers train only the experts carrying that share of tokens
    experts_with: str = "router,shared,attention,rest"  # what trains with the chosen experts ("none": nothing)
    experts_sample: int = 8  # training batches whose routing picks the experts


@dataclass
class OptimConfig:
    name: str = "adam"  # adam, adamw, sgd
    lr: float | None = None  # None: the paper's default (sgd 0.1, adam/adamw 5e-5)
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    momentum: float = 0.9
    weight_decay: float | None = None  # None: sgd 1e-5, adam 0, adamw 0.01
    warmup_steps: int = 0  # linear warmup at the start of every visit
    decay: str = "none"  # none, linear, cosine: after warmup the rate falls to 0 at each visit's last step
    grad_clip: float = 0.0  # max gradient norm of the active block; 0 disables
    grad_accum: int = 1  # micro-batches per optimizer step
    keep_state: bool = False  # keep each block's optimizer state between its visits (costs its memory)


@dataclass
class StopConfig:
    steps_per_visit: int | None = None
    epochs_per_visit: float | None = None
    patience: int | None = None  # plateau: smoothed loss not improved by min_delta for this many steps
    min_delta: float = 0.0
    smoothing: float = 0.9  # exponential smoothing of the training loss for the plateau rule


@dataclass
class RunConfig:
    out: str = "runs/bcd"
    mode: str = "bcd"  # bcd, or full (full-parameter baseline: one block)
    seed: int = 0
    checkpoint_every: int = 0  # optimizer steps between checkpoints; 0: after every visit only
    device: str = "cpu"
    precision: str = "auto"  # fp32, bf16-mixed, fp16-mixed; auto follows the model's weights (bf16 -> bf16-mixed)
    recompute: bool = False  # keep one hidden state per layer in the gradient path; run the layer again in backward
    pipeline: int = 1  # pipeline stages (under torchrun: world size = pipeline x data-parallel replicas)
    microbatches: int = 0  # micro-batches per step through the pipeline; 0: as many as stages
    schedule: str = "1f1b"  # pipeline schedule: 1f1b or gpipe


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


# Keys of [run] in configs written before it was split: (section, key) they moved to.
MOVED_RUN_KEYS = {
    "pre_inference": ("pre_inference", "mode"),
    "store_dir": ("pre_inference", "store_dir"),
    "store_format": ("pre_inference", "store_format"),
    "store_dtype": ("pre_inference", "store_dtype"),
    "keep_stores": ("pre_inference", "keep_stores"),
    "dask": ("pre_inference", "dask"),
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
    return config


def _read_toml(path: Path) -> dict:
    try:
        with path.open("rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise UsageError(f"config file {path} does not exist") from None
    except tomllib.TOMLDecodeError as err:
        raise UsageError(f"config file {path} is not valid TOML: {err}") from None


def _apply(config: Config, values: dict, source: str) -> None:
    for section, entries in values.items():
        target = getattr(config, section, None)
        if not is_dataclass(target) or not isinstance(entries, dict):
            raise UsageError(f"{source}: unknown config section [{section}]")
        hints = get_type_hints(type(target))
        for key, value in entries.items():
            if section == "data" and key == "eval_batches":
                raise UsageError(f"{source}: [data] eval_batches is gone: write eval_tokens (tokens evaluated; 0: all)")
            if section == "run" and key in MOVED_RUN_KEYS:
                new_section, new_key = MOVED_RUN_KEYS[key]
                raise UsageError(f"{source}: [run] {key} has moved: write it as {new_key} in [{new_section}]")
            if key not in hints:
                raise UsageError(f"{source}: unknown key '{key}' in [{section}]")
            if value is not None:
                setattr(target, key, _coerce(value, hints[key], f"{source}: [{section}] {key}"))


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
    raise TypeError(f"cannot write {value!r} as TOML")
