"""Pre-inference over several processes (data-parallel ranks, or a pipeline's stages and replicas): the numbers every
rank plans with, agreed over the process group, so that all ranks make the same plans and build and read the same
stores."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from pipelines.pre_inference.sweep_plan import Throughputs


def agreed(rates: Throughputs, world: int, device: torch.device) -> Throughputs:
    """`rates` alone in one process, else the slowest rank's (`slowest`)."""
    return rates if world == 1 else slowest(rates, device)


def least(value: float, world: int, device: torch.device) -> float:
    """The smallest of every rank's `value` (the free disk: the ranks may write to disks of their own)."""
    return value if world == 1 else _all_reduce([value], dist.ReduceOp.MIN, device)[0]


def slowest(rates: Throughputs, device: torch.device) -> Throughputs:
    """Under data parallelism, the throughputs every rank plans with: the slowest rank's (a step waits for every
    rank), so that all ranks make the same plans and build and read the same stores."""
    blocks = sorted(rates.step_seconds)  # the same visits on every rank
    values = [rates.layer_seconds, rates.build_layer, _inverse(rates.write_bps), _inverse(rates.read_bps),
              rates.store_overhead_s, *(rates.step_seconds[b] for b in blocks)]
    layer, build, write, read, overhead, *steps = _all_reduce(values, dist.ReduceOp.MAX, device)
    return Throughputs(layer, _inverse(write), _inverse(read), overhead, dict(zip(blocks, steps)),
                       None if rates.build_layer_seconds is None else build)


def _all_reduce(values: list[float], op: dist.ReduceOp, device: torch.device) -> list[float]:
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=op)
    return tensor.tolist()


def _inverse(value: float) -> float:
    """1 / value, with 1 / 0 = inf and 1 / inf = 0 (speeds of storage that costs nothing)."""
    return math.inf if value == 0 else 1 / value
