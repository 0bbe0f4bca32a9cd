"""One step's micro-batches in layer-major order (`--stream-frozen`): every micro-batch through a layer before the
next layer, in forward and again in backward, so that one copy of a streamed layer serves the whole step.

Forward runs the layers from the batches' boundary up: those below the active block under `no_grad`, the rest
with autograd, each layer's input cut from the graph below it (a leaf that requires a gradient), so that its
backward can run on its own. Each micro-batch's head and loss then run forward and backward at once (its logits
are never held beside another's), and backward goes down the layers, each layer's micro-batches in order, each
one a backward call from the layer's output with the gradient its input got from the layer above. A layer is
evicted after its forward and fetched again for its backward (with `--recompute` that is where it runs again),
but the top layer, whose backward follows at once.

The same operations run as in the resident step (`preinfer.forward_backward`), on the same inputs, and every
trained tensor gets one gradient per micro-batch, in micro-batch order, so losses and weights are bit-identical
to it; with landscape expansion's factors, mixed precision's master gradients and the fused step too, since each
hook fires once per micro-batch as there. The two exceptions a cut graph makes are handled here:

- a tensor the embedding and the head share (a tied input embedding trained in its block's visit) gets the sum of
  both uses per micro-batch there, in one accumulation: its head gradient is held until the embedding's backward
  of the same micro-batch and accumulated with it; such a visit runs its micro-batches one at a time (each a
  layer-major pass of its own), so that one head gradient is held at a time;
- dropout draws its masks in the order the layers run, which here is another order than the resident step's
  (the models preinfer streams, Llama's kin, have none).

The cost: the activations (or, with `--recompute`, the layer inputs) of every micro-batch of the step are held
at once, `grad_accum` times the resident step's.
"""

from __future__ import annotations

import torch

from preinfer.boundary_state import BoundaryState
from preinfer.errors import PreinferError
from preinfer.forward_backward import batch_state, micro_batch_loss
from preinfer.moe import RouterLoss
from preinfer.partition import Block
from preinfer.staged import StagedModel


def layer_major(staged: StagedModel, batches: list[dict], block: Block, boundary: int, count: torch.Tensor,
                visit, router_loss: RouterLoss, router_share: int, recompute: bool, stream) -> float:
    """Forward and backward of every micro-batch of a step, layer-major, over `stream`'s layers (a
    `preinfer.stream_frozen.LayerStream`); returns the sum of their losses (as `forward_backward`'s)."""
    if boundary > block.start:
        raise PreinferError(f"a source at boundary {boundary} cannot feed block {block.index} "
                            f"(it starts at boundary {block.start})")
    embedded = boundary == 0 and block.has_embed
    tied = _tied(staged) if embedded else []
    groups = [[batch] for batch in batches] if tied else [batches]
    total = 0.0
    with stream.holding():
        for index, group in enumerate(groups):
            pass_ = _Pass(staged, block, boundary, count, visit, router_loss, router_share, recompute, stream,
                          tied, last=index == len(groups) - 1)
            total += pass_.run(group, embedded)
    return total


def _tied(staged: StagedModel) -> list[torch.nn.Parameter]:
    """The trained tensors both the embedding and the head use."""
    embed = {id(p) for m in staged.embed_modules() for p in m.parameters()}
    return [p for p in _head_params(staged) if id(p) in embed]


def _head_params(staged: StagedModel) -> list[torch.nn.Parameter]:
    found = {id(p): p for m in staged.head_modules() for p in m.parameters() if p.requires_grad}
    return list(found.values())


class _Pass:
    """One layer-major forward and backward over a group of micro-batches."""

    def __init__(self, staged: StagedModel, block: Block, boundary: int, count: torch.Tensor, visit,
                 router_loss: RouterLoss, router_share: int, recompute: bool, stream, tied: list, last: bool):
        self.staged, self.block, self.boundary, self.count, self.visit = staged, block, boundary, count, visit
        self.router_loss, self.router_share, self.recompute, self.stream = router_loss, router_share, recompute, stream
        self.tied, self.last = tied, last

    def run(self, group: list[dict], embedded: bool) -> float:
        staged, top = self.staged, self.staged.num_layers
        if embedded:
            states = [staged.embed(b["input_ids"], b["attention_mask"], b["labels"]) for b in group]
        else:
            with torch.no_grad():
                states = [batch_state(staged, b, self.boundary) for b in group]
        calls = [staged.layer_calls(state, self.boundary, top) for state in states]
        graph, hidden, routed = self._forward(states, calls)
        grads, held, total = self._heads(states, hidden, routed)
        self._backward(graph, grads)
        if embedded:
            for k, state in enumerate(states):
                self._flag(k, len(states))
                torch.autograd.backward([state.hidden, *self.tied], [grads[k], *held[k]])
        return total

    def _forward(self, states: list[BoundaryState], calls: list) -> tuple[list, list, list]:
        """Every layer from the boundary up over every micro-batch: the autograd layers' (input, output) pairs,
        the top layer's outputs and each micro-batch's recorded router logits."""
        top, start = self.staged.num_layers, self.block.start
        hidden = [state.hidden for state in states]
        routed: list[list[torch.Tensor]] = [[] for _ in states]
        graph = []
        for i in range(self.boundary, top):
            self.stream.use(i, i + 1)
            grad, pairs = i >= start, []
            for k, call in enumerate(calls):
                x = hidden[k].detach().requires_grad_() if grad and hidden[k].requires_grad else hidden[k]
                with torch.set_grad_enabled(grad), self.router_loss.capture(start):
                    hidden[k] = self.staged.run_layer(call[i - self.boundary], x, self.recompute)
                if grad:
                    routed[k].extend(self.router_loss.logits)
                    pairs.append((x, hidden[k]))
            if grad:
                graph.append(pairs)
            if i < top - 1:
                self.stream.evict(i)
        return graph, hidden, routed

    def _heads(self, states: list[BoundaryState], hidden: list[torch.Tensor],
               routed: list[list[torch.Tensor]]) -> tuple[list, list, float]:
        """Each micro-batch's head, loss and its backward down to the top layer's output: the gradients there,
        the tied tensors' head gradients held for the embedding's backward, and the summed loss."""
        grads, held, total = [], [], 0.0
        for k, state in enumerate(states):
            h = hidden[k].detach().requires_grad_() if hidden[k].requires_grad else hidden[k]
            self.router_loss.logits = routed[k]
            out = BoundaryState(h, state.attention_mask, state.position_ids, state.labels)
            loss = micro_batch_loss(self.staged, out, self.count, self.router_loss, self.router_share)
            self._flag(k, len(states))
            scaled = self.visit.scale_loss(loss)
            held.append(self._head_backward(scaled, h) if self.tied else [])
            if not self.tied:
                scaled.backward()
            total += loss.item()
            grads.append(h.grad if h.requires_grad else None)
        return grads, held, total

    def _head_backward(self, scaled: torch.Tensor, h: torch.Tensor) -> list[torch.Tensor]:
        """The head's backward where it shares tensors with the embedding: the input's gradient and every other
        head tensor's accumulated, the shared tensors' returned."""
        params = _head_params(self.staged)
        inputs = [h, *params] if h.requires_grad else params
        found = dict(zip(map(id, inputs), torch.autograd.grad(scaled, inputs, allow_unused=True)))
        if h.requires_grad:
            h.grad = found[id(h)]
        shared = {id(p) for p in self.tied}
        for param in params:
            if id(param) not in shared and found[id(param)] is not None:
                torch.autograd.backward([param], [found[id(param)]])
        return [found[id(p)] for p in self.tied]

    def _backward(self, graph: list, grads: list) -> None:
        """Down the autograd layers, each layer's micro-batches in order; `grads` ends as the gradients of the
        lowest autograd layer's inputs."""
        start = self.block.start
        for j in reversed(range(len(graph))):
            i = start + j
            self.stream.use(i, i - 1 if i > start else None)
            for k, (x, y) in enumerate(graph[j]):
                self._flag(k, len(graph[j]))
                if grads[k] is not None and y.requires_grad:
                    torch.autograd.backward(y, grads[k])
                grads[k] = x.grad if x.requires_grad else None
            graph[j] = None
            self.stream.evict(i)

    def _flag(self, k: int, n: int) -> None:
        """Whether micro-batch `k` of `n` is the step's last (the fused step and the reducer act on it)."""
        self.visit.active.last_micro_batch = self.last and k == n - 1
