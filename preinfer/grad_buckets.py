"""Data-parallel gradient reduction in flat fp32 buckets, launched during backward as the buckets fill.

The active block's gradients (fp32: the masters' under mixed precision) are grouped, in reverse order of the
block's parameters (roughly the order backward produces them), into buckets of at most `bucket_bytes`. When the
last gradient of a bucket is complete in the step's last micro-batch, the bucket is copied into its flat buffer
and an asynchronous all-reduce starts, while backward goes on with the layers below. Buckets are launched in
bucket order on every rank (a bucket that fills early waits for the ones before it), so the ranks issue the same
collectives in the same order. `finish()` launches whatever is left, waits, and copies the sums back.

Each element is summed across ranks exactly as a per-tensor all-reduce would sum it, so the result does not
depend on the bucketing. The flat buffers are one more fp32 copy of the active block's gradients, kept for the
visit. `--grad-compression` chooses how a bucket is summed (`preinfer.grad_compression`: as it is, in bf16, or as
PowerSGD's low-rank factors).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from preinfer.grad_compression import gradient_sum
from preinfer.wire import Wire

BUCKET_BYTES = 25 * 2**20


class BucketedAllReduce:
    """Sums the gradients of `tensors` over the group of `wire` (by default the default process group, counted),
    bucket by bucket, each as `compression` sums it (with the sum's `state` from a mid-visit checkpoint)."""

    def __init__(self, tensors: list[torch.Tensor], bucket_bytes: int = BUCKET_BYTES, wire: Wire | None = None,
                 compression: str = "none", state: list[torch.Tensor] = ()):
        self.tensors = tensors
        self.buckets: list[list[int]] = []
        size = 0
        for index in reversed(range(len(tensors))):
            nbytes = tensors[index].numel() * 4
            if not self.buckets or size + nbytes > bucket_bytes:
                self.buckets.append([])
                size = 0
            self.buckets[-1].append(index)
            size += nbytes
        self.bucket_of = {i: b for b, members in enumerate(self.buckets) for i in members}
        self.flat = [torch.empty(sum(tensors[i].numel() for i in members), dtype=torch.float32,
                                 device=tensors[members[0]].device) for members in self.buckets]
        shapes = [[tensors[i].shape for i in members] for members in self.buckets]
        device = tensors[0].device if tensors else torch.device("cpu")
        self.sum = gradient_sum(compression, wire if wire is not None else Wire(), shapes, device)
        self.sum.load(list(state))
        self.start_step()

    def state(self) -> list[torch.Tensor]:
        """The sum's state a mid-visit checkpoint carries (PowerSGD's)."""
        return self.sum.state()

    def start_step(self) -> None:
        """Expect every gradient again (call before the step's backward passes)."""
        self.missing = [len(members) for members in self.buckets]
        self.launched: list[Callable[[], None]] = []  # per launched bucket: what waits for its sum

    def grad_ready(self, index: int) -> None:
        """Tensor `index`'s gradient is final for this step: launch every bucket that is now complete, in order."""
        self.missing[self.bucket_of[index]] -= 1
        while len(self.launched) < len(self.buckets) and self.missing[len(self.launched)] == 0:
            self._launch(len(self.launched))

    def finish(self) -> None:
        """Launch the buckets not yet launched (a tensor without a gradient counts as zeros), wait for all, and
        write the sums into the gradients."""
        for bucket in range(len(self.launched), len(self.buckets)):
            self._launch(bucket)
        for wait, bucket in zip(self.launched, range(len(self.buckets))):
            wait()
            offset = 0
            for index in self.buckets[bucket]:
                grad = self.tensors[index].grad
                grad.copy_(self.flat[bucket][offset:offset + grad.numel()].view_as(grad))
                offset += grad.numel()

    def _launch(self, bucket: int) -> None:
        offset = 0
        for index in self.buckets[bucket]:
            tensor = self.tensors[index]
            if tensor.grad is None:
                tensor.grad = torch.zeros_like(tensor, dtype=torch.float32)
            self.flat[bucket][offset:offset + tensor.numel()].copy_(tensor.grad.reshape(-1))
            offset += tensor.numel()
        self.launched.append(self.sum.launch(bucket, self.flat[bucket]))
