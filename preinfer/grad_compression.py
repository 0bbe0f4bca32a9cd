"""How step sync sums a bucket of gradients over the replicas (`--grad-compression`), each sum through the wire.

- `none`: the fp32 bucket, all-reduced as it is (asynchronous: launched in backward, waited for at the step's end).
- `bf16`: the bucket cast to bf16, all-reduced, cast back: half the bytes (torch's `bf16_compress_hook`, without
  its division by the world size: the buckets hold shares of the global mean, whose sum is the mean).
- `powersgd:R`: PowerSGD (Vogels et al. 2019, torch's `powerSGD_hook`): each gradient matrix M of n x m (a tensor
  of two or more dimensions, its first one by the rest, where (n + m) R < n m) is summed as rank-R factors: P = M Q
  summed and orthonormalised, then Q = M^T P summed, and the sum taken as P Q^T; one power iteration a step, Q
  warm-started from the last step's. The other tensors of the bucket are summed uncompressed. Error feedback:
  each replica adds to its next gradient what the factors left out of its own, M - P (M^T P)^T, so nothing is
  lost, only delayed. `powersgd:R:W` sums the first W steps of each visit uncompressed (torch's
  `start_powerSGD_iter`, whose default is 1000 steps of a run: the first steps' gradients are the largest and
  change fastest, and Adam's moments are built from them). The steps, Q and error tensors are the compressor's
  state, which a mid-visit checkpoint carries; a new visit (a new block) starts them afresh.
  Its sums run when the step's backward has ended (two rounds, not overlapped with backward).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from preinfer.config.sync_rules import parse_grad_compression
from preinfer.errors import UsageError
from preinfer.wire import Wire

class PlainSum:
    """`none`: the bucket all-reduced in fp32."""

    def __init__(self, wire: Wire):
        self.wire = wire

    def launch(self, bucket: int, flat: torch.Tensor) -> Callable[[], None]:
        """Start summing `flat`; returns what waits for the sum to be in it."""
        return self.wire.all_reduce(flat, async_op=True).wait

    def state(self) -> list[torch.Tensor]:
        """What a mid-visit checkpoint carries (nothing)."""
        return []

    def load(self, state: list[torch.Tensor]) -> None:
        if state:
            raise UsageError("the checkpoint holds a PowerSGD state: resume with the grad_compression the "
                             "checkpoint was trained with")


class Bf16Sum(PlainSum):
    """`bf16`: the bucket all-reduced in bf16."""

    def launch(self, bucket: int, flat: torch.Tensor) -> Callable[[], None]:
        half = flat.to(torch.bfloat16)
        work = self.wire.all_reduce(half, async_op=True)

        def wait() -> None:
            work.wait()
            flat.copy_(half)
        return wait


class PowerSgdSum(PlainSum):
    """`powersgd:R:W` over buckets of tensors of `shapes` (per bucket, in the bucket's order), the first `warmup`
    steps summed plainly."""

    def __init__(self, wire: Wire, rank: int, shapes: list[list[torch.Size]], device: torch.device, warmup: int = 0):
        super().__init__(wire)
        self.shapes, self.warmup = shapes, warmup
        self.steps = torch.zeros(1, dtype=torch.int64)  # begun, of this visit
        self.q: dict[tuple[int, int], torch.Tensor] = {}
        self.error: dict[tuple[int, int], torch.Tensor] = {}
        for b, bucket in enumerate(shapes):
            for i, shape in enumerate(bucket):
                n, m = (shape[0], shape[1:].numel()) if len(shape) >= 2 else (0, 0)
                r = min(rank, n, m)
                if r and (n + m) * r < n * m:
                    generator = torch.Generator().manual_seed(1000 * b + i)  # the same on every replica
                    self.q[b, i] = torch.randn(m, r, generator=generator).to(device)
                    self.error[b, i] = torch.zeros(n, m, device=device)

    def state(self) -> list[torch.Tensor]:
        """The steps begun, every Q, then every error, in bucket order."""
        return [self.steps, *self.q.values(), *self.error.values()]

    def load(self, state: list[torch.Tensor]) -> None:
        """Continue from a mid-visit checkpoint's `state` (none: a fresh start)."""
        mine = self.state()
        if not state:
            return
        if [t.shape for t in state] != [t.shape for t in mine]:
            raise UsageError("the checkpoint's PowerSGD state does not fit this run's: resume with the "
                             "grad_compression the checkpoint was trained with")
        for tensor, saved in zip(mine, state):
            tensor.copy_(saved)

    def launch(self, bucket: int, flat: torch.Tensor) -> Callable[[], None]:
        """Start summing `flat` (bucket 0 begins a step): plainly during the warm-up, else once backward ends."""
        if bucket == 0:
            self.steps += 1
        if int(self.steps) <= self.warmup:
            return super().launch(bucket, flat)
        return lambda: self._sum(bucket, flat)

    @torch.no_grad()
    def _sum(self, bucket: int, flat: torch.Tensor) -> None:
        views, offset = [], 0
        for shape in self.shapes[bucket]:
            views.append(flat[offset:offset + shape.numel()])
            offset += shape.numel()
        keys = [(bucket, i) for i in range(len(views)) if (bucket, i) in self.q]
        plain = [views[i] for i in range(len(views)) if (bucket, i) not in self.q]
        matrices = {key: views[key[1]].view(self.error[key].shape) + self.error[key] for key in keys}
        rest = torch.cat(plain) if plain else None
        work = self.wire.all_reduce(rest, async_op=True) if rest is not None else None
        ps = self._summed([matrices[key] @ self.q[key] for key in keys])
        ps = [torch.linalg.qr(p).Q for p in ps]
        local = [matrices[key].T @ p for key, p in zip(keys, ps)]
        qs = self._summed(local)
        for key, p, mine, q in zip(keys, ps, local, qs):
            self.error[key] = matrices[key] - p @ mine.T
            self.q[key] = q
            views[key[1]].copy_((p @ q.T).reshape(-1))
        if work is not None:
            work.wait()
            offset = 0
            for view in plain:
                view.copy_(rest[offset:offset + view.numel()])
                offset += view.numel()

    def _summed(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """`tensors` summed over the replicas in one flat all-reduce."""
        if not tensors:
            return []
        flat = torch.cat([t.reshape(-1) for t in tensors])
        self.wire.all_reduce(flat)
        return [part.view_as(t) for part, t in zip(flat.split([t.numel() for t in tensors]), tensors)]


def gradient_sum(compression: str, wire: Wire, shapes: list[list[torch.Size]], device: torch.device) -> PlainSum:
    """The bucket sum `compression` names, over buckets of tensors of `shapes` on `device`."""
    powersgd = parse_grad_compression(compression)
    if powersgd is not None:
        rank, warmup = powersgd
        return PowerSgdSum(wire, rank, shapes, device, warmup)
    return Bf16Sum(wire) if compression == "bf16" else PlainSum(wire)
