"""Seconds per step of each `--dp-sync` mode on `nodes` data-parallel replicas joined by one link each, against the
step's compute, and the scaling efficiency they leave.

A visit of block k moves the block's fp32 tensors (its gradients under step sync, its masters at a sync) through a
ring all-reduce: each node sends 2 (n - 1) / n of them (`preinfer.wire` counts the same). Step sync does so every
step (bf16 compression: half the bytes); visit sync once a visit (`steps_per_visit` steps), every:N once every N
steps. A step's compute is its tokens (micro-batch x sequence) times the visit's FLOPs per token
(`preinfer.memory.cost.visit_flops`) at the GPU's peak times the MFU. The traffic is assumed not to overlap the
compute (the buckets' overlap with backward is not counted), so the efficiency, compute / (compute + traffic)
summed over one sweep's visits of equal steps, is a floor.
"""

from __future__ import annotations

from preinfer.memory.cost import visit_flops
from preinfer.memory.layer_spans import LayerSpan, block_params
from preinfer.memory.settings import GPUS, Settings
from preinfer.memory.shapes import ModelShape

EVERY = 10  # the every:N the plan prices


def sync_cost(m: ModelShape, settings: Settings, blocks: list[LayerSpan]) -> dict | None:
    """Per mode: bytes a node sends per step, seconds of traffic and of compute per step, scaling efficiency; None
    for one node or a GPU without peak FLOPs."""
    nodes = settings.nodes
    gpu = GPUS.get(settings.gpu, {})
    peak = gpu.get("tflops_fp32" if settings.dtype == "float32" else "tflops_bf16")
    if nodes < 2 or peak is None:
        return None
    link = settings.bandwidth_gbps * 1e9 / 8
    ring = 2 * (nodes - 1) / nodes
    tokens = settings.micro_batch * settings.seq_len
    compute = [tokens * flops / (peak * 1e12 * settings.mfu) for flops in visit_flops(m, blocks)]
    sent = [ring * 4 * block_params(m, b) for b in blocks]
    syncs_per_step = {"step": 1.0, "step+bf16": 0.5, f"every:{EVERY}": 1 / EVERY,
                      "visit": 1 / settings.steps_per_visit}
    modes = {}
    for mode, share in syncs_per_step.items():
        traffic = [share * nbytes / link for nbytes in sent]
        modes[mode] = dict(
            bytes_per_step=share * sum(sent) / len(sent), seconds_per_step=sum(traffic) / len(traffic),
            efficiency=sum(compute) / (sum(compute) + sum(traffic)),
        )
    return dict(nodes=nodes, bandwidth_gbps=settings.bandwidth_gbps, steps_per_visit=settings.steps_per_visit,
                compute_seconds_per_step=sum(compute) / len(compute), modes=modes)
