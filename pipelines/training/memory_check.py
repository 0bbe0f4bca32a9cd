"""A run's memory against the plan, before the model loads: the planner's figure for the run's largest visit (the
`bcd live` row `preinfer plan` prints for the same flags, `preinfer.memory.footprint.bcd_memory`) against the memory
its device has (`available_memory`: the host's MemAvailable on the CPU, the card's free memory on CUDA). A run
that cannot fit is refused in one line naming both and what to change; `[run] skip_memory_check` runs it anyway."""

from __future__ import annotations

import os
from pathlib import Path

import torch

import preinfer
from preinfer.config import Config
from preinfer.errors import UsageError
from preinfer.memory.budget import size_text
from preinfer.memory.footprint import bcd_memory
from preinfer.memory.layer_spans import block_spans
from preinfer.memory.shapes import shape_from_config
from preinfer.partition import Partition
from pipelines.models.partition_choice import run_settings

MEMINFO = Path("/proc/meminfo")


def available_memory(device: str) -> tuple[int, str] | None:
    """(bytes the run's `device` has for it, a phrase saying so with `{}` for the figure): on the CPU the kernel's
    estimate of memory available without swapping, on CUDA the card's free memory; None where neither is read."""
    if device.startswith("cuda") and torch.cuda.is_available():
        free, _ = torch.cuda.mem_get_info(None if device == "cuda" else torch.device(device))
        return free, f"GPU {device} has {{}} free"
    if device == "cpu" and MEMINFO.is_file():
        for line in MEMINFO.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024, "the host has {} available (MemAvailable)"
    return None


def check_memory(config: Config, staged: preinfer.StagedModel, partition: Partition, active: int | None,
                 precision: str) -> None:
    """Refuse, in one line, a run whose largest visit (of the `active` block alone, where one is) the planner puts
    above the memory its device has: on the CPU, shared by the ranks of this host. A run the planner does not price
    (it refuses to: a mixture-of-experts model with a frozen dtype, 8-bit moments, the fused step or expansion,
    which `preinfer plan` prices for dense models only) is not checked."""
    if config.run.skip_memory_check:
        return
    found = available_memory(config.run.device)
    if found is None:
        return
    available, where = found
    ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1")) if config.run.device == "cpu" else 1
    spans = block_spans(partition)
    visits = range(len(spans)) if active is None else [active]
    try:
        settings = run_settings(staged, config, precision, available // ranks)
        shape = shape_from_config(staged.model.config)
        largest = max((bcd_memory(shape, settings, spans, k, store=False) for k in visits), key=lambda m: m.total)
    except UsageError:  # a run the planner does not price (a frozen dtype or 8-bit moments on experts): unchecked
        return
    if largest.total * ranks <= available:
        return
    each = f" for each of the host's {ranks} ranks" if ranks > 1 else ""
    skip = config.naming.key("run", "skip_memory_check")
    raise UsageError(f"the plan puts this run's largest visit, {largest.note}, at {size_text(largest.total)}{each} "
                     f"({precision}; preinfer plan's bcd live row), but {where.format(size_text(available))}: "
                     f"{remedies(config, len(spans), staged.num_layers)}, or {skip} to run it anyway")


def remedies(config: Config, blocks: int, layers: int) -> str:
    """What would shrink the largest visit, each named as the config's source names it."""
    changes = [] if config.run.recompute else [config.naming.key("run", "recompute")]
    if config.data.batch_size > 1:
        changes.append(f"a smaller {config.naming.key('data', 'batch_size')}")
    if blocks < layers and config.blocks.active is None:
        changes.append(f"more blocks ({config.naming.key('blocks', 'blocks')})")
    return "give " + ", ".join(changes) if changes else "give a device with more memory"

