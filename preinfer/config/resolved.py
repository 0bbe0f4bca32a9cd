"""The run resolved: every `auto` of a config settled once (`resolve_run`) into one immutable `ResolvedRun`, which
the run record (`preinfer plan --json`'s `resolved`, a run's `resolved` record in metrics.jsonl) writes, and the
rules judge the config as it resolved (`check_resolved`), not as it was written."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from preinfer.config.choices import RESIDENT_DTYPE_NAMES, names
from preinfer.config.rules import Naming, Problem, check, resolved_expand
from preinfer.config.sections import Config


@dataclass(frozen=True)
class ResolvedRun:
    """A run's settled values: no `auto` left."""

    precision: str  # fp32, bf16-mixed or fp16-mixed
    expand: str  # none, lowrank or sgd
    frozen_dtype: str  # the frozen linear weights' dtype: the resident one (float32, bfloat16, float16), or a code
    store_dtype: str  # the dtype boundary states are stored in
    blocks: int  # blocks of the partition (with separate ends, the embedding and head blocks included)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def resolve_run(config: Config, precision: str, sparse: bool, blocks: int) -> ResolvedRun:
    """The run of `config` in the resolved `precision`, on a model with sparse (mixture-of-experts) layers or not,
    partitioned into `blocks` blocks."""
    resident = RESIDENT_DTYPE_NAMES[str(precision)]  # what auto stores and holds
    store, frozen = config.pre_inference.store_dtype, config.model.frozen_dtype
    return ResolvedRun(precision=str(precision), expand=resolved_expand(config, sparse),
                       frozen_dtype=resident if frozen == "auto" else frozen,
                       store_dtype=resident if store == "auto" else store, blocks=blocks)


class ResolvedNaming(Naming):
    """Names a key as `naming` does, and a precision that `auto` resolved as what it resolved to."""

    def __init__(self, naming: Naming, requested: str, resolved: str):
        self.naming, self.requested, self.resolved = naming, requested, resolved

    def key(self, section: str, key: str) -> str:
        name = self.naming.key(section, key)
        if (section, key) == ("run", "precision") and self.requested != self.resolved:
            return f"{name} {self.requested}, resolved from the model's weights to"
        return name

    def value(self, section: str, key: str, value: Any) -> str:
        if (section, key) == ("run", "precision") and self.requested != self.resolved:
            return f"{self.key(section, key)} {value}"
        return self.naming.value(section, key, value)


def check_resolved(config: Config, precision: str, naming: Naming | None = None, blocks: int | None = None,
                   sparse: bool | None = None, widest: int | None = None) -> Config:
    """`config` if every rule holds for the run it resolves to (the precision `auto` became: `precision`; where
    they are known, the partition's `blocks`, whether the model has `sparse` (mixture-of-experts) layers and the
    `widest` narrow side of its layers' linear weights, `preinfer.expansion.widest_rank`); else
    the one-line UsageError of `Config.validate`, naming a key as `naming` does (by default as its source gave it,
    `config.naming`) and a resolved precision as what it resolved from and to."""
    resolved = dataclasses.replace(config, run=dataclasses.replace(config.run, precision=str(precision)))
    check(resolved, ResolvedNaming(naming or config.naming, config.run.precision, str(precision)),
          model_problems(config, blocks, sparse, widest))
    return config


def model_problems(config: Config, blocks: int | None, sparse: bool | None,
                   widest: int | None = None) -> Iterator[Problem]:
    """The rules of the model's partition and layers: a listed block rate per block, a fixed order of every block,
    a start block among them; experts only where there are sparse layers; a low-rank expansion's rank no wider than
    the `widest` narrow side of the linear weights (a wider one holds no more, at rank x (in + out) floats each)."""
    rates = config.optim.block_lr
    if blocks is not None and rates is not None and ":" not in rates and len(names(rates)) != blocks:
        yield "optim", "block_lr", f"{blocks} factors, one per block of the partition (or a rule depth:LO..HI)"
    fixed = config.blocks.fixed_order
    if blocks is not None and fixed is not None and sorted(int(part) for part in fixed.split(",")) != [*range(blocks)]:
        yield "blocks", "fixed_order", f"each of the partition's blocks 0-{blocks - 1} named once (it has {blocks})"
    start = config.blocks.start_block
    if blocks is not None and start is not None and start >= blocks:
        yield "blocks", "start_block", f"one of the partition's blocks 0-{blocks - 1}"
    rank = config.blocks.expand_rank
    if widest is not None and rank > widest and resolved_expand(config, bool(sparse)) == "lowrank":
        yield "blocks", "expand_rank", (f"at most {widest}, the widest narrow side of the model's linear weights (a "
                                        f"rank-{widest} update is already full rank on every one)")
    if sparse is False and config.blocks.experts is not None:
        yield "blocks", "experts", "unset on a model without mixture-of-experts layers (it has no experts to choose)"
