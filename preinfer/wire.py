"""The bytes a rank sends to its data-parallel replicas, counted at each collective it calls (`Wire`).

Every collective the data-parallel seams issue (the gradient buckets, the token count, the loss, the stop
agreement, a visit's average) goes through a `Wire`, which counts what this rank sends for the tensor it hands
over: an all-reduce over n ranks sends 2 (n - 1) / n of the tensor's bytes from each rank (reduce-scatter then
all-gather, the ring algorithm of gloo's and NCCL's large all-reduces). The counts are read per step
(`take_step`) and per visit (`take_visit`) into metrics.jsonl's step and visit records (`sent_bytes`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class Wire:
    """Collectives over `group` (None: the default group) whose bytes this rank sends are counted."""

    def __init__(self, group: dist.ProcessGroup | None = None):
        self.group = group
        self.step_bytes = 0
        self.visit_bytes = 0

    def all_reduce(self, tensor: torch.Tensor, op: dist.ReduceOp = dist.ReduceOp.SUM,
                   async_op: bool = False) -> dist.Work | None:
        """`dist.all_reduce` of `tensor` over the wire's group, counted."""
        ranks = dist.get_world_size(self.group)
        self.count(2 * (ranks - 1) * tensor.numel() * tensor.element_size() // ranks)
        return dist.all_reduce(tensor, op=op, group=self.group, async_op=async_op)

    def count(self, nbytes: int) -> None:
        self.step_bytes += nbytes
        self.visit_bytes += nbytes

    def take_step(self) -> int:
        """The bytes sent since the last call (a step's)."""
        sent, self.step_bytes = self.step_bytes, 0
        return sent

    def take_visit(self) -> int:
        """The bytes sent since the last call (a visit's)."""
        sent, self.visit_bytes = self.visit_bytes, 0
        return sent
