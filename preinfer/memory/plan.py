"""The plan `preinfer plan` reports: memory per GPU (on a pipeline, per stage: each stage its own card), the
automatic partition, store size, traffic and cost."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from preinfer.errors import UsageError
from preinfer.memory.cost import cost
from preinfer.memory.expansion import planned_expand
from preinfer.memory.footprint import Memory, auto_choice, full_memory, full_pipeline_degree, worst_bcd
from preinfer.memory.layer_spans import partition
from preinfer.memory.settings import DTYPES, GPUS, USABLE_FRACTION, Settings
from preinfer.memory.shapes import ModelShape
from preinfer.memory.streaming import stream_timing
from preinfer.memory.stage_cut import stage_cost, stage_label, stage_rows
from preinfer.memory.traffic import store_bytes_per_token, store_dtype, traffic


@dataclass
class MemoryPlan:
    """Everything `preinfer plan` reports."""

    model: dict
    settings: dict
    capacity_bytes: int
    weight_bytes: int
    memory: dict[str, Memory]
    auto: dict
    full_adam_pipeline_degree: int | None
    store: dict
    traffic: dict
    cost: dict | None
    notes: list[str] = field(default_factory=list)
    stages: list[dict] | None = None  # with `pipeline` > 1: BCD's stage cut, each stage's layers and peak bytes
    stream: dict | None = None  # with `stream_frozen` on a GPU: a streamed layer's copy against its compute

    def to_dict(self) -> dict:
        """A JSON-ready dict."""
        return asdict(self)


def plan_memory(m: ModelShape, settings: Settings) -> MemoryPlan:
    """The full plan for a model shape and settings."""
    if settings.gpu_mem_gb is None and settings.gpu not in GPUS:
        raise UsageError(f"unknown GPU '{settings.gpu}'; use one of {', '.join(GPUS)} or --gpu-mem GB")
    if settings.dtype not in DTYPES:
        raise UsageError(f"unknown dtype '{settings.dtype}'; use one of {', '.join(DTYPES)}")
    blocks = partition(m, settings.blocks, settings.separate_ends)
    stages = None
    if (settings.pipeline or 1) > 1:
        memory, cut = stage_rows(m, settings, settings.pipeline, blocks)
        stages = [dict(start=stage.start, stop=stage.stop, embed=stage.embed, head=stage.head,
                       label=stage_label(stage),
                       peak_bytes=stage_cost(m, settings, stage, j, len(cut), blocks, len(cut), "1f1b"))
                  for j, stage in enumerate(cut)]
    else:
        memory = {
            "full_adam": full_memory(m, settings, recompute=False),
            "full_adam_recompute": full_memory(m, settings, recompute=True),
            "bcd_live": worst_bcd(m, settings, blocks, store=False),
            "bcd_store": worst_bcd(m, settings, blocks, store=True),
        }
    auto = auto_choice(m, settings)
    degree = settings.pipeline or max(2, auto["pipeline_degree"] or 2)
    per_token = store_bytes_per_token(m, settings)
    store = dict(dtype=store_dtype(settings), bytes_per_token=per_token,
                 bytes_per_boundary=None if not settings.tokens else per_token * settings.tokens)
    return MemoryPlan(
        model=asdict(m) | dict(params=m.total_params()),
        settings=asdict(settings) | dict(ufp=1 / settings.blocks, expand=planned_expand(m, settings)),
        capacity_bytes=settings.capacity(),
        weight_bytes=m.total_params() * DTYPES[settings.dtype]["weight"],
        memory=memory, auto=auto, full_adam_pipeline_degree=full_pipeline_degree(m, settings),
        store=store, traffic=traffic(m, settings, degree), cost=cost(m, settings, blocks),
        notes=[
            f"fits = total <= {USABLE_FRACTION:.0%} of the GPU's memory (CUDA context and fragmentation)",
            "BCD rows are the worst visit; from a store excludes block 0, which has no prefix and trains live",
        ], stages=stages, stream=stream_timing(m, settings),
    )
