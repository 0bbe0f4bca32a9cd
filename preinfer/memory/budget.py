"""Blocks chosen by a memory budget (`--ufp auto`): the fewest visits whose every one fits, the ends' placement
chosen too (`footprint.best_fit`), by the memory model of `preinfer plan` (`preinfer.memory`), or, when even one
layer per block does not fit, what would."""

from __future__ import annotations

from dataclasses import replace

from preinfer.errors import UsageError
from preinfer.memory.footprint import best_fit, placements, visit_peaks, worst_bcd
from preinfer.memory.layer_spans import partition
from preinfer.config.choices import DEFAULT_LOSS_CHUNK
from preinfer.memory.settings import GIB, PRECISION_DTYPES, Settings
from preinfer.memory.shapes import ModelShape
from preinfer.metrics import BudgetPlanRecord



def size_text(n: float) -> str:
    """Bytes as MiB below 1 GiB, else as GiB, with two decimals."""
    return f"{n / GIB:.2f} GiB" if n >= GIB else f"{n / 2**20:.2f} MiB"


def budget_settings(budget: int, precision: str, seq_len: int, micro_batch: int, recompute: bool,
                    attention: str, *, frozen_dtype: str = "auto", optimizer: str = "adam", fused_step: bool = False,
                    host_device: bool = False, expand: str = "auto", expand_rank: int = 8,
                    separate_ends: bool = False, stream_frozen: bool = False, masters: str = "host",
                    loss: str = "auto", loss_chunk: int = DEFAULT_LOSS_CHUNK, offload: bool = False) -> Settings:
    """The planner's settings of a run under a memory budget of `budget` bytes, with the memory savers it uses
    (`separate_ends`: the run asks for the ends apart; else the plan chooses their placement; `stream_frozen`,
    `masters`: the run's `[model]` keys)."""
    if precision not in PRECISION_DTYPES:
        raise UsageError(f"precision '{precision}' is not one of {', '.join(PRECISION_DTYPES)}")
    return Settings(seq_len=seq_len, micro_batch=micro_batch, dtype=PRECISION_DTYPES[precision],
                    recompute=recompute, attention=attention, budget_bytes=budget, frozen_dtype=frozen_dtype,
                    optimizer=optimizer, fused_step=fused_step, host_device=host_device, expand=expand,
                    expand_rank=expand_rank, separate_ends=separate_ends, stream_frozen=stream_frozen,
                    masters=masters, loss=loss, loss_chunk=loss_chunk, offload=offload)


def blocks_for_budget(m: ModelShape, settings: Settings, precision: str) -> BudgetPlanRecord:
    """The automatic partition on one GPU (`best_fit`: the fewest visits whose every live one fits
    `settings.capacity()`, and where the ends go), with each visit's predicted peak; a UsageError naming what would
    fit when even one layer per block does not."""
    fit = best_fit(m, settings)
    if fit is None:
        raise UsageError(_nothing_fits(m, settings))
    peaks = visit_peaks(m, settings, partition(m, fit.blocks, fit.separate_ends))
    return BudgetPlanRecord(budget=settings.capacity(), blocks=fit.blocks, predicted=peaks, precision=precision,
                            recompute=settings.recompute, seq_len=settings.seq_len, micro_batch=settings.micro_batch,
                            separate_ends=fit.separate_ends)


def _nothing_fits(m: ModelShape, settings: Settings) -> str:
    """One line: the smallest visit's need against the budget, and the changes that would fit it."""
    worst = min((worst_bcd(m, settings, partition(m, m.layers, apart), store=False) for apart in placements(settings)),
                key=lambda memory: memory.total)
    fits = []
    if not settings.recompute and (found := best_fit(m, replace(settings, recompute=True))):
        fits.append(f"--recompute ({_blocks_text(found.blocks, found.separate_ends)}, {size_text(found.peak)} "
                    f"per visit)")
    for batch in range(settings.micro_batch - 1, 0, -1):
        if found := best_fit(m, replace(settings, micro_batch=batch)):
            fits.append(f"--batch-size {batch} ({_blocks_text(found.blocks, found.separate_ends)}, "
                        f"{size_text(found.peak)} per visit)")
            break
    for degree in range(2, m.layers + 1):
        if found := best_fit(m, settings, degree):
            fits.append(f"a pipeline of {degree} GPUs ({_blocks_text(found.blocks, found.separate_ends)}, "
                        f"{size_text(found.peak)} per GPU)")
            break
    head = (f"memory budget {size_text(settings.capacity())}: even one layer per block needs "
            f"{size_text(worst.total)} for {worst.note}")
    if not fits:
        return f"{head}; nothing fits it, not even one layer per GPU in a pipeline"
    return f"{head}; would fit: {', or '.join(fits)}"


def _blocks_text(blocks: int, separate_ends: bool) -> str:
    """`5 blocks`, or `5 blocks + the embedding and head blocks`."""
    return f"{blocks} blocks" + (" + the embedding and head blocks" if separate_ends else "")


def budget_line(record: BudgetPlanRecord) -> str:
    """The plan as one readable line."""
    peaks = ", ".join(size_text(p) for p in record.predicted)
    largest = max(record.predicted)
    return (f"memory budget {size_text(record.budget)}: {record.blocks} blocks (UFP 1/{record.blocks})"
            f"{' + the embedding and head blocks' if record.separate_ends else ''}; "
            f"predicted peak per visit {peaks} (largest {largest / record.budget:.0%} of the budget; "
            f"{record.precision}, seq {record.seq_len} x micro-batch {record.micro_batch}"
            f"{', recompute' if record.recompute else ''})")


def visit_against_budget(peak: int, budget: int) -> str:
    """A visit's measured peak against the budget, as a phrase."""
    share = f"{peak / budget:.0%} of the {size_text(budget)} budget"
    return share if peak <= budget else f"OVER the budget: {share}"
