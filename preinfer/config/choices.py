"""The enumerated values of the config, each written once as a `Literal`, and `choices`, which reads them back from
a section's field: the flags, the TOML reader, the HF arguments and the reference pages all take them from there.
A field typed `Names[X]` holds a comma list of X's values (as its flag takes it)."""

from __future__ import annotations

import functools
from types import UnionType
from typing import Annotated, Any, Literal, Union, get_args, get_origin, get_type_hints

from preinfer.errors import UsageError

# Attention implementations a model runs with (transformers' names): PyTorch's scaled_dot_product_attention
# (flash and memory-efficient kernels where the device has them), or the framework's eager matmul-softmax-matmul.
Attention = Literal["sdpa", "eager"]
# Block orders within a sweep; the importance orders are measured at every sweep's start (preinfer.importance).
BlockOrder = Literal["ascending", "descending", "random", "fixed", "importance", "importance-cached"]
# adam8bit, adamw8bit: blockwise 8-bit moments (preinfer.low_bit, the torchao extra).
Optimizer = Literal["sgd", "adam", "adamw", "adam8bit", "adamw8bit"]
# transformers' schedules by name (get_scheduler) that need no options of their own; "none" is constant_with_warmup.
LrDecay = Literal["none", "linear", "cosine", "cosine_with_restarts", "polynomial", "constant_with_warmup",
                  "inverse_sqrt"]
# A visit's stopping rules: its budgets (steps, epochs, plateau), or those and the gain rule (preinfer.gain).
StopRuleName = Literal["budget", "gain"]
Mode = Literal["bcd", "full"]
Precision = Literal["auto", "fp32", "bf16-mixed", "fp16-mixed"]
PipelineSchedule = Literal["1f1b", "gpipe"]
# The experiment trackers `report_to` may name (pipelines.training.trackers); "none" names none.
Tracker = Literal["none", "tensorboard", "wandb", "mlflow"]
PreInferenceMode = Literal["off", "on", "auto"]
StoreFormat = Literal["zarr", "safetensors"]
# auto: the compute dtype (bit-exact); then the exact dtypes, then the lossy 8-bit encodings (storage.encodings).
StoreDtype = Literal["auto", "float32", "bfloat16", "float16", "float8_e4m3", "float8_e5m2", "int8"]
# What trains with an expert-granular block's chosen experts (preinfer.moe); "none" names nothing.
ExpertPart = Literal["none", "router", "shared", "attention", "rest"]
# How the frozen decoder layers' linear weights are held for their forward (preinfer.frozen_weights); auto: in the
# resident dtype, as every other weight.
FrozenDtype = Literal["auto", "bf16", "int8", "nf4"]
# Where the masters live (preinfer.mapped_masters): in host memory, or memory-mapped from safetensors files (the
# model's own, then the run's own for the blocks it has trained).
Masters = Literal["host", "disk"]
# Landscape expansion over the suffix (preinfer.expansion): rank-r factors per linear weight, plain SGD, or none;
# auto: lowrank where it runs (a dense model's BCD run without what it does not run with), else none.
Expand = Literal["auto", "none", "lowrank", "sgd"]
# How the next-token loss is computed (preinfer.chunked_loss): from the whole logits, in chunks of tokens (auto:
# wherever the head is one linear map and its terms), or by Liger Kernel's fused kernel (CUDA, the liger extra).
Loss = Literal["auto", "chunked", "plain", "liger"]
# Tokens a chunk of the chunked loss: one chunk of Llama-3's 128,256-token vocabulary is 0.12 GiB of float32 logits,
# and its backward holds 0.31 GiB more in bf16, with the head input's gradient (the planner's `loss_workspace`).
DEFAULT_LOSS_CHUNK = 256

# The reference paper's defaults of the optimizers.
DEFAULT_LR = {"sgd": 0.1, "adam": 5e-5, "adamw": 5e-5, "adam8bit": 5e-5, "adamw8bit": 5e-5}
DEFAULT_WEIGHT_DECAY = {"sgd": 1e-5, "adam": 0.0, "adamw": 0.01, "adam8bit": 0.0, "adamw8bit": 0.01}


class Names:
    """`Names[X]`: a str holding a comma list of the values of the Literal X."""

    def __class_getitem__(cls, kind: Any) -> Any:
        return Annotated[str, kind]


def _plain(hint: Any) -> Any:
    """A field's hint without None (an optional field's value type)."""
    if get_origin(hint) in (Union, UnionType):
        kept = [arg for arg in get_args(hint) if arg is not type(None)]
        return kept[0] if len(kept) == 1 else hint
    return hint


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    """`cls`'s field hints, `Names[X]` kept: resolved once per class (a config's validation asks hundreds of times,
    and each resolution evaluates every hint of the class again)."""
    return get_type_hints(cls, include_extras=True)


def field_hint(cls: type, name: str) -> Any:
    """The type of field `name` of the dataclass `cls`, None left out, `Names[X]` kept."""
    return _plain(_hints(cls)[name])


def is_optional(cls: type, name: str) -> bool:
    """Whether field `name` of section `cls` may be None (unset)."""
    return type(None) in get_args(_hints(cls)[name])


def is_names(hint: Any) -> bool:
    """Whether a (plain) hint is `Names[X]`, a comma list."""
    return get_origin(hint) is Annotated


def choices_of(hint: Any) -> tuple[str, ...]:
    """The values a (plain) hint allows: a Literal's, or for `Names[X]` the names it may list; () when open."""
    if is_names(hint):
        return choices_of(get_args(hint)[1])
    return get_args(hint) if get_origin(hint) is Literal else ()


def choices(cls: type, name: str) -> tuple[str, ...]:
    """The values field `name` of section `cls` allows (for a comma list, its names); () when it is open."""
    return choices_of(field_hint(cls, name))


def names(text: str) -> list[str]:
    """The names in a comma list."""
    return [name.strip() for name in text.split(",") if name.strip()]


def check_attention(attention: str, where: str = "--attention") -> str:
    """`attention` if it is one of ATTENTIONS, else a one-line UsageError naming `where`."""
    if attention not in ATTENTIONS:
        raise UsageError(f"{where} {attention!r}: expected one of {', '.join(ATTENTIONS)}")
    return attention


def parse_experts(text: str) -> float:
    """`top:0.5` -> 0.5: the share of a layer's routed tokens that the trained experts must carry."""
    kind, _, share = text.partition(":")
    try:
        value = float(share)
    except ValueError:
        value = -1.0
    if kind != "top" or not 0 < value <= 1:
        raise UsageError(f"--experts '{text}' is not top:SHARE with SHARE in (0, 1], e.g. top:0.5")
    return value


ATTENTIONS: tuple[str, ...] = get_args(Attention)
DEFAULT_ATTENTION = "sdpa"
ORDERS: tuple[str, ...] = get_args(BlockOrder)
IMPORTANCE_ORDERS = tuple(order for order in ORDERS if order.startswith("importance"))
LR_DECAYS: tuple[str, ...] = get_args(LrDecay)
# Schedules defined without a last step (the others fall to their end at each visit's last step).
OPEN_ENDED_DECAYS = ("none", "constant_with_warmup", "inverse_sqrt")
# The optimizers with blockwise 8-bit moments (preinfer.low_bit, the torchao extra).
LOW_BIT_OPTIMIZERS: tuple[str, ...] = ("adam8bit", "adamw8bit")
TRACKERS = tuple(name for name in get_args(Tracker) if name != "none")
# The dtypes a store may hold boundary states in (auto: the compute dtype): the one list the planner, the caching
# job and the flags read; a name's bits are its first number (float8_e4m3: 8, bfloat16: 16).
STORE_DTYPES: tuple[str, ...] = tuple(name for name in get_args(StoreDtype) if name != "auto")
# The training precisions a run resolves to (auto: follows the model's weights): `preinfer.precision.Precision`,
# and the dtype each holds every weight in (what a store's and the frozen weights' auto hold).
RUN_PRECISIONS: tuple[str, ...] = tuple(name for name in get_args(Precision) if name != "auto")
RESIDENT_DTYPE_NAMES: dict[str, str] = dict(zip(RUN_PRECISIONS, ("float32", "bfloat16", "float16"), strict=True))
EXPERT_PARTS = tuple(name for name in get_args(ExpertPart) if name != "none")
