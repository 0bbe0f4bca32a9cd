"""When data-parallel replicas agree (`--dp-sync`), and the outer step that makes them agree (`OuterStep`).

- `step` (the default): the active block's gradients are summed over the replicas at every step (the bucketed
  all-reduce, `preinfer.grad_buckets`), so every replica takes the same step.
- `visit`: each replica trains the active block on its own shard of the batches for the whole visit, as one
  process would; at the visit's end the replicas average the block. Only one block changes during a visit, so a
  visit is the fragment Streaming DiLoCo syncs, by construction.
- `every:N`: the same, averaging every N steps of a visit, and at its end.

The average is plain (`--outer-lr 1 --outer-momentum 0`, computed directly: the mean of the replicas' tensors), or
DiLoCo's outer step: the outer gradient is the anchor (the block at the last sync) minus the replicas' mean, and
SGD with Nesterov momentum steps the anchor by it (`buf = mu buf + g; anchor -= lr (g + mu buf)`); the momentum
lasts the visit. Under mixed precision the fp32 masters are averaged and cast down into the 16-bit weights, so
the invariant that the resident weights are the masters cast down holds after each sync.

The outer state (anchor, momentum, steps since the last sync) travels in a mid-visit checkpoint
(`OuterStep.state` / `load`), so a resumed run continues it exactly.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from preinfer.errors import UsageError
from preinfer.wire import Wire

class OuterStep:
    """Averages `tensors` (the active block's fp32 masters) over the wire's replicas, plainly or by DiLoCo's outer
    Nesterov step; `cast_down` then writes them into the resident weights."""

    def __init__(self, tensors: list[torch.Tensor], wire: Wire, lr: float, momentum: float, cast_down,
                 state: list[torch.Tensor] | None = None):
        self.tensors, self.wire, self.lr, self.momentum, self.cast_down = tensors, wire, lr, momentum, cast_down
        self.plain = lr == 1.0 and momentum == 0.0
        self.steps = 0  # since the last sync
        self.anchor = [] if self.plain else [t.detach().clone() for t in tensors]
        self.buffer = [] if self.plain or momentum == 0.0 else [torch.zeros_like(t) for t in tensors]
        if state:
            self.load(state)

    def state(self) -> list[torch.Tensor]:
        """What a mid-visit checkpoint carries: the steps since the last sync, the anchor and the momentum."""
        return [torch.tensor([self.steps], dtype=torch.int64), *self.anchor, *self.buffer]

    def load(self, state: list[torch.Tensor]) -> None:
        """Continue from `state` (this step's `state()` of the same visit)."""
        expected = 1 + len(self.anchor) + len(self.buffer)
        if len(state) != expected:
            raise UsageError(f"the checkpoint's outer step holds {len(state)} tensors, this run's {expected}: resume "
                             f"with the dp_sync, outer_lr and outer_momentum it was trained with")
        self.steps = int(state[0])
        with torch.no_grad():
            for mine, saved in zip([*self.anchor, *self.buffer], state[1:]):
                mine.copy_(saved)

    def stepped(self) -> None:
        """One optimizer step of the visit was taken (whether or not it updated)."""
        self.steps += 1

    @torch.no_grad()
    def sync(self) -> None:
        """The replicas' block made one: their mean (one flat all-reduce), or the outer step from it."""
        if not self.tensors:
            return
        flat = torch.cat([t.detach().reshape(-1).float() for t in self.tensors])
        self.wire.all_reduce(flat)
        flat /= dist.get_world_size(self.wire.group)
        offset = 0
        for index, tensor in enumerate(self.tensors):
            mean = flat[offset:offset + tensor.numel()].view_as(tensor)
            offset += tensor.numel()
            tensor.copy_(mean if self.plain else self._outer(index, mean))
        self.cast_down()
        self.steps = 0

    def _outer(self, index: int, mean: torch.Tensor) -> torch.Tensor:
        """The anchor stepped by SGD with Nesterov momentum along the outer gradient (anchor - mean)."""
        anchor = self.anchor[index]
        grad = anchor - mean
        if self.buffer:
            buffer = self.buffer[index]
            buffer.mul_(self.momentum).add_(grad)
            grad = grad.add(buffer, alpha=self.momentum)
        anchor.sub_(grad, alpha=self.lr)
        return anchor
