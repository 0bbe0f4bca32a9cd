"""Which config keys a resumed run may change, and the refusal of the others."""

from __future__ import annotations

from typing import Any

from preinfer.config.rules import Naming
from preinfer.config.sections import Config
from preinfer.errors import UsageError

# Config keys a resumed run may change: where and how it runs, not what it trains, the number of sweeps (a run
# resumed for more sweeps ends as one run of that many) and the step budget (a raised one continues the visit it
# cut and ends as one run of that budget, bit for bit) and whether its memory is checked against the plan. Each
# change is recorded in metrics.jsonl as a `resume` record; a change of any other key refuses --resume.
RESUMABLE_KEYS = ("run.checkpoint_every", "run.device", "run.skip_memory_check", "run.report_to", "data.token_store",
                  "pre_inference.dask", "blocks.sweeps", "stop.total_steps")
# The block partition: the first of these that is set wins (ranges, then blocks, then ufp).
PARTITION_ORDER = ("ranges", "blocks", "ufp")


def resume_changes(saved: Config, asked: Config) -> dict[str, list[Any]]:
    """{"section.key": [saved value, asked value]} for every config key in which `asked` differs from the run's
    saved config; the run directory's own path is not compared (it may have moved), the partition by the choice
    that wins."""
    before, after = _comparable(saved), _comparable(asked)
    return {key: [before[key], after[key]] for key in before if before[key] != after[key] and key != "run.out"}


def refused_changes(saved: Config, asked: Config) -> dict[str, list[Any]]:
    """The changes of `resume_changes` that a resume may not make (keys outside RESUMABLE_KEYS): the one
    resume-compatibility check of `preinfer bcd --resume` and of `preinfer.hf`'s checkpoints."""
    return {key: change for key, change in resume_changes(saved, asked).items() if key not in RESUMABLE_KEYS}


def check_resume(saved: Config, asked: Config, where: str, naming: Naming | None = None) -> dict[str, list[Any]]:
    """The changes of `resume_changes` when every one is in RESUMABLE_KEYS; else refuse, listing the others, each
    named as `naming` names its key (by default `[section] key`)."""
    naming = naming or Naming()
    refused = [f"{naming.key(*key.split('.'))} {before!r} -> {after!r}"
               for key, (before, after) in refused_changes(saved, asked).items()]
    if refused:
        allowed = ", ".join(f"[{key.replace('.', '] ', 1)}" for key in RESUMABLE_KEYS)
        raise UsageError(f"--resume continues the run in {where} as configured, but the flags change "
                         f"{'; '.join(refused)}; drop them (only {allowed} may change) or start a new run in "
                         f"another --out")
    return resume_changes(saved, asked)


def _comparable(config: Config) -> dict[str, Any]:
    values = {f"{section}.{key}": value for section, entries in config.to_dict().items()
              for key, value in entries.items()}
    chosen = next((key for key in PARTITION_ORDER if values[f"blocks.{key}"] is not None), None)
    for key in PARTITION_ORDER:
        if key != chosen:
            values[f"blocks.{key}"] = None
    return values
