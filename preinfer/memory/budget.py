"""Blocks chosen by a memory budget (`--ufp auto`): the fewest blocks whose every visit fits, by the memory model of
`preinfer plan` (`preinfer.memory`), or, when even one layer per block does not fit, what would."""

from __future__ import annotations

from dataclasses import replace

from preinfer.errors import UsageError
from preinfer.memory.footprint import bcd_memory, fewest_blocks, worst_bcd
from preinfer.memory.layer_spans import partition
from preinfer.memory.settings import GIB, PRECISION_DTYPES, Settings
from preinfer.memory.shapes import ModelShape
from preinfer.metrics import BudgetPlanRecord



def size_text(n: float) -> str:
    """Bytes as MiB below 1 GiB, else as GiB, with two decimals."""
    return f"{n / GIB:.2f} GiB" if n >= GIB else f"{n / 2**20:.2f} MiB"


def budget_settings(budget: int, precision: str, seq_len: int, micro_batch: int, recompute: bool,
                    attention: str, *, frozen_dtype: str = "auto", optimizer: str = "adam", fused_step: bool = False,
                    host_device: bool = False, expand: str = "auto", expand_rank: int = 8) -> Settings:
    """The planner's settings of a run under a memory budget of `budget` bytes, with the memory savers it uses."""
    if precision not in PRECISION_DTYPES:
        raise UsageError(f"precision '{precision}' is not one of {', '.join(PRECISION_DTYPES)}")
    return Settings(seq_len=seq_len, micro_batch=micro_batch, dtype=PRECISION_DTYPES[precision],
                    recompute=recompute, attention=attention, budget_bytes=budget, frozen_dtype=frozen_dtype,
                    optimizer=optimizer, fused_step=fused_step, host_device=host_device, expand=expand,
                    expand_rank=expand_rank)


def blocks_for_budget(m: ModelShape, settings: Settings, precision: str) -> BudgetPlanRecord:
    """The fewest blocks whose every live visit fits `settings.capacity()`, with each visit's predicted peak;
    a UsageError naming what would fit when even one layer per block does not."""
    found = fewest_blocks(m, settings)
    if found is None:
        raise UsageError(_nothing_fits(m, settings))
    blocks = partition(m, found[0])
    peaks = [bcd_memory(m, settings, blocks, k, store=False).total for k in range(len(blocks))]
    return BudgetPlanRecord(budget=settings.capacity(), blocks=len(blocks), predicted=peaks, precision=precision,
                            recompute=settings.recompute, seq_len=settings.seq_len, micro_batch=settings.micro_batch)


def _nothing_fits(m: ModelShape, settings: Settings) -> str:
    """One line: the smallest visit's need against the budget, and the changes that would fit it."""
    worst = worst_bcd(m, settings, partition(m, m.layers), store=False)
    fits = []
    if not settings.recompute and (found := fewest_blocks(m, replace(settings, recompute=True))):
        fits.append(f"--recompute ({found[0]} blocks, {size_text(found[1])} per visit)")
    for batch in range(settings.micro_batch - 1, 0, -1):
        if found := fewest_blocks(m, replace(settings, micro_batch=batch)):
            fits.append(f"--batch-size {batch} ({found[0]} blocks, {size_text(found[1])} per visit)")
            break
    for degree in range(2, m.layers + 1):
        if found := fewest_blocks(m, settings, degree):
            fits.append(f"a pipeline of {degree} GPUs ({found[0]} blocks, {size_text(found[1])} per GPU)")
            break
    head = (f"memory budget {size_text(settings.capacity())}: even one layer per block needs "
            f"{size_text(worst.total)} for {worst.note}")
    if not fits:
        return f"{head}; nothing fits it, not even one layer per GPU in a pipeline"
    return f"{head}; would fit: {', or '.join(fits)}"


def budget_line(record: BudgetPlanRecord) -> str:
    """The plan as one readable line."""
    peaks = ", ".join(size_text(p) for p in record.predicted)
    largest = max(record.predicted)
    return (f"memory budget {size_text(record.budget)}: {record.blocks} blocks (UFP 1/{record.blocks}); "
            f"predicted peak per visit {peaks} (largest {largest / record.budget:.0%} of the budget; "
            f"{record.precision}, seq {record.seq_len} x micro-batch {record.micro_batch}"
            f"{', recompute' if record.recompute else ''})")


def visit_against_budget(peak: int, budget: int) -> str:
    """A visit's measured peak against the budget, as a phrase."""
    share = f"{peak / budget:.0%} of the {size_text(budget)} budget"
    return share if peak <= budget else f"OVER the budget: {share}"
