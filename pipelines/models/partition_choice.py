"""Which blocks a run trains: the partition the config asks for, or the fewest blocks that fit a memory budget."""

from __future__ import annotations

from dataclasses import replace

import preinfer
from preinfer.memory.budget import blocks_for_budget, budget_settings
from preinfer.config import BlockConfig, Config
from preinfer.chunked_loss import LinearHead
from preinfer.errors import UsageError
from preinfer.expansion import expansion_of
from preinfer.memory.settings import Settings
from preinfer.memory.shapes import shape_from_config
from preinfer.partition import Partition, make_partition, parse_ranges, parse_ufp


def partition_for(staged: preinfer.StagedModel, config: Config, first_layer: int = 0,
                  precision: str = "fp32") -> tuple[Partition, int | None]:
    """The blocks of the run and the one to train alone (`blocks.active`) or None. Full mode is one block;
    otherwise ranges, then a block count, then UFP, whichever is set first; UFP auto plans the fewest blocks
    that fit the memory budget in `precision` (see `budget_partition`)."""
    b = config.blocks  # its keys and the rules between them hold (`Config.validate`)
    if b.active is not None:
        ranges, active = _active_ranges(b.active, first_layer, staged.num_layers)
        return make_partition(staged, ranges=ranges, first_layer=first_layer), active
    if config.run.mode == "full":
        return make_partition(staged, num_blocks=1, first_layer=first_layer), None
    common = dict(separate_ends=b.separate_ends, first_layer=first_layer)
    if b.ranges is not None:
        return make_partition(staged, ranges=b.ranges, **common), None
    if b.blocks is not None:
        return make_partition(staged, num_blocks=b.blocks, **common), None
    if b.ufp == "auto":
        return budget_partition(staged, config, first_layer, precision), None
    return make_partition(staged, ufp=parse_ufp(b.ufp), **common), None


def budget_partition(staged: preinfer.StagedModel, config: Config, first_layer: int, precision: str) -> Partition:
    """The planner's automatic partition under the memory budget (`preinfer.memory.budget.blocks_for_budget`: the
    fewest visits whose every live one fits, the ends inside the first and last block or apart, as `preinfer plan`
    chooses at the same precision, recomputation, sequence length and micro-batch), the plan attached; exit 2
    naming what would fit when even one layer per block does not."""
    if first_layer:
        raise UsageError("--ufp auto plans whole-model runs (preinfer bcd); give --ufp or --blocks to train from "
                         "a store")
    shape = shape_from_config(staged.model.config)
    settings = run_settings(staged, config, precision, memory_budget(config.blocks))
    plan = blocks_for_budget(shape, settings, precision)
    return replace(make_partition(staged, num_blocks=plan.blocks, separate_ends=plan.separate_ends), budget=plan)


def run_settings(staged: preinfer.StagedModel, config: Config, precision: str, budget: int) -> Settings:
    """The planner's settings of the run `config` on `staged` in `precision` (its memory savers, expansion and loss
    as the run applies them), under a budget of `budget` bytes: what `preinfer plan` prices for the same flags."""
    together = config.optim.grad_accum if config.model.stream_frozen else 1  # layer-major: a step's micro-batches
    return budget_settings(budget, precision, config.data.seq_len, config.data.batch_size * together,
                           config.run.recompute, config.model.attention, frozen_dtype=config.model.frozen_dtype,
                           optimizer=config.optim.name, fused_step=config.optim.fused_step,
                           host_device=config.run.device == "cpu", expand=expansion_of(staged, config),
                           expand_rank=config.blocks.expand_rank, separate_ends=config.blocks.separate_ends,
                           stream_frozen=config.model.stream_frozen, masters=config.model.masters,
                           loss=config.run.loss if isinstance(staged.linear_head(), LinearHead) else "plain",
                           loss_chunk=config.run.loss_chunk, offload=config.run.offload)


def memory_budget(blocks: BlockConfig) -> int:
    """Bytes of [blocks] memory_budget, or the planner's usable memory of [blocks] gpu (exactly one is set: the
    config's rules, `preinfer.config.rules.partition_problems`)."""
    return Settings(gpu=blocks.gpu).capacity() if blocks.gpu is not None else blocks.memory_budget


def _active_ranges(active: str, first: int, num_layers: int) -> tuple[str, int]:
    """`--active a-b` as a partition of layers [first, L) whose block number `index` is exactly a..b."""
    found = parse_ranges(active, num_layers, first=first, cover=False)
    if len(found) != 1:
        raise UsageError(f"--active '{active}' must be one layer range such as 4-5")
    lo, hi = found[0]
    pieces = [(a, b) for a, b in ((first, lo), (lo, hi), (hi, num_layers)) if b > a]
    return ",".join(f"{a}-{b - 1}" for a, b in pieces), pieces.index((lo, hi))
