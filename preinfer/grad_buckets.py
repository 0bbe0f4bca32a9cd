"""Data-parallel gradient reduction in flat fp32 buckets, launched during backward as the buckets fill.

The active block's gradients (fp32: the masters' under mixed precision) are grouped, in reverse order of the
block's parameters (roughly the order backward produces them), into buckets of at most `bucket_bytes`. When the
last gradient of a bucket is complete in the step's last micro-batch, the bucket is copied into its flat buffer
and an asynchronous all-reduce starts, while backward goes on with the layers below. Buckets are launched in
bucket order on every rank (a bucket that fills early waits for the ones before it), so the ranks issue the same
collectives in the same order. `finish()` launches whatever is left, waits, and copies the sums back.

Each element is summed across ranks exactly as a per-tensor all-reduce would sum it, so the result does not
depend on the bucketing. A bucket's flat buffer (an fp32 copy of its gradients) lives from its launch until its
sums are written back.

With the fused step (`on_reduced`, the step of one tensor), each tensor steps once its sum is back: when a bucket
is launched, every bucket before it is waited for, written back and stepped while backward goes on, so the step
still frees each gradient during backward, one bucket behind the all-reduce.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

BUCKET_BYTES = 25 * 2**20


class BucketedAllReduce:
    """Sums the gradients of `tensors` over `group` (None: the default process group), bucket by bucket, and hands
    each summed tensor's index to `on_reduced` (the fused step) when it is given."""

    def __init__(self, tensors: list[torch.Tensor], bucket_bytes: int = BUCKET_BYTES,
                 group: dist.ProcessGroup | None = None, on_reduced: Callable[[int], None] | None = None):
        self.tensors, self.group, self.on_reduced = tensors, group, on_reduced
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
        self.start_step()

    def start_step(self) -> None:
        """Expect every gradient again (call before the step's backward passes)."""
        self.missing = [len(members) for members in self.buckets]
        self.launched: list[tuple[dist.Work, torch.Tensor]] = []  # each launched bucket's work and flat buffer
        self.written = 0  # the buckets whose sums are back in the gradients

    def grad_ready(self, index: int) -> None:
        """Tensor `index`'s gradient is final for this step: launch every bucket that is now complete, in order
        (with `on_reduced`, write back and step the buckets before the last one launched)."""
        self.missing[self.bucket_of[index]] -= 1
        while len(self.launched) < len(self.buckets) and self.missing[len(self.launched)] == 0:
            self._launch(len(self.launched))
        if self.on_reduced is not None:
            self._write_back(len(self.launched) - 1)

    def finish(self) -> None:
        """Launch the buckets not yet launched (a tensor without a gradient counts as zeros), wait for all, and
        write the sums into the gradients."""
        for bucket in range(len(self.launched), len(self.buckets)):
            self._launch(bucket)
        self._write_back(len(self.buckets))

    def _write_back(self, stop: int) -> None:
        """Wait for the launched buckets before bucket `stop` whose sums are not back yet, write them into the
        gradients, free their buffers, and hand their tensors to `on_reduced`."""
        while self.written < stop:
            work, flat = self.launched[self.written]
            work.wait()
            offset = 0
            for index in self.buckets[self.written]:
                grad = self.tensors[index].grad
                grad.copy_(flat[offset:offset + grad.numel()].view_as(grad))
                offset += grad.numel()
            self.launched[self.written] = (work, None)
            if self.on_reduced is not None:
                for index in self.buckets[self.written]:
                    self.on_reduced(index)
            self.written += 1

    def _launch(self, bucket: int) -> None:
        members = self.buckets[bucket]
        flat = torch.empty(sum(self.tensors[i].numel() for i in members), dtype=torch.float32,
                           device=self.tensors[members[0]].device)
        offset = 0
        for index in members:
            tensor = self.tensors[index]
            if tensor.grad is None:
                tensor.grad = torch.zeros_like(tensor, dtype=torch.float32)
            flat[offset:offset + tensor.numel()].copy_(tensor.grad.reshape(-1))
            offset += tensor.numel()
        self.launched.append((dist.all_reduce(flat, group=self.group, async_op=True), flat))
