"""Mixture-of-experts models: their sparse blocks, batch-invariant experts, the routers' load-balancing loss,
and the parameters a token activates.

A sparse block is a layer's `mlp` with a router `gate` (weight [E, H], `top_k`) and fused `experts` whose
parameters are 3-D tensors [E, ...] (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE in transformers 5).

Batch invariance: transformers' default `grouped_mm` experts run one matrix product per expert over the tokens
routed to it, and the BLAS picks its kernel by the number of rows (here a product over one or two rows takes
another path than one over three, with another summation order). A token's output thus depended on how many
other tokens of its batch chose the same expert, so stored states (computed in dataset order) and the live
prefix (computed in shuffled training batches) differed in the last bits, which training amplified (most visibly
in the attention key biases, whose true gradient is zero and whose Adam steps are driven by rounding noise).
`ROW_INVARIANT` runs every expert product over fixed tiles of `TILE_ROWS` rows (the last one zero-padded), so
each product has the same shape whatever the batch and a token's output depends on that token alone.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn
from transformers.integrations.moe import ExpertsInterface

ROW_INVARIANT = "row_invariant"
TILE_ROWS = 16


def row_invariant_experts_forward(
    self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """The fused experts' forward (gate-up, activation, down, routing weight, summed over the top k) with every
    matrix product over tiles of `TILE_ROWS` rows."""
    out = torch.zeros_like(hidden_states)
    hidden = hidden_states.shape[-1]
    for expert in top_k_index.unique().tolist():
        if expert >= self.num_experts:
            continue
        token, slot = (top_k_index == expert).nonzero(as_tuple=True)
        rows = len(token)
        tiles = F.pad(hidden_states[token], (0, 0, 0, -rows % TILE_ROWS)).view(-1, TILE_ROWS, hidden)
        gate_up = torch.bmm(tiles, self.gate_up_proj[expert].T.expand(len(tiles), -1, -1))
        down = torch.bmm(self._apply_gate(gate_up), self.down_proj[expert].T.expand(len(tiles), -1, -1))
        weighted = down.reshape(-1, hidden)[:rows] * top_k_weights[token, slot, None]
        out.index_add_(0, token, weighted.to(out.dtype))
    return out


ExpertsInterface.register(ROW_INVARIANT, row_invariant_experts_forward)


def sparse_blocks(layers) -> dict[int, nn.Module]:
    """Layer index -> that layer's sparse MoE block, for the layers that have one."""
    found = {}
    for index, layer in enumerate(layers):
        mlp = getattr(layer, "mlp", None)
        if _is_sparse(mlp):
            found[index] = mlp
    return found


def _is_sparse(module: nn.Module | None) -> bool:
    gate, experts = getattr(module, "gate", None), getattr(module, "experts", None)
    return (
        gate is not None and experts is not None and hasattr(gate, "top_k")
        and any(p.dim() == 3 for p in experts.parameters(recurse=False))
    )


def use_row_invariant_experts(model: nn.Module) -> None:
    """Switch a model that runs the default grouped experts to `ROW_INVARIANT` (the same function, each token's
    arithmetic independent of its batch)."""
    config = getattr(model, "config", None)
    if getattr(config, "_experts_implementation", None) == "grouped_mm":
        config._experts_implementation = ROW_INVARIANT


def expert_tensors(layers) -> dict[int, float]:
    """id of each fused expert tensor -> the share of it one token uses (top_k / num_experts)."""
    return {
        id(p): block.gate.top_k / p.shape[0]
        for block in sparse_blocks(layers).values()
        for p in block.experts.parameters(recurse=False)
        if p.dim() == 3
    }


class RouterLoss:
    """The load-balancing loss of the routers a step runs with autograd, as the model's framework defines it.

    `capture(start)` records the router logits of the sparse layers at and above `start` during a forward;
    `loss(attention_mask)` is then `router_aux_loss_coef` times the framework's `load_balancing_loss_func` over
    them (0 for a dense model, a zero coefficient, or when nothing was recorded). Under activation recomputation
    the layer forward runs without autograd, so the logits are recomputed from the router's input: the loss then
    reaches the router weights but not the hidden states below them.
    """

    def __init__(self, model: nn.Module, layers):
        self.blocks = sparse_blocks(layers)
        self.coef = float(getattr(model.config, "router_aux_loss_coef", 0.0) or 0.0) if self.blocks else 0.0
        self.function = getattr(sys.modules[type(model).__module__], "load_balancing_loss_func", None)
        self.logits: list[torch.Tensor] = []
        if self.blocks and self.coef and self.function is None:
            self.coef = 0.0

    @contextmanager
    def capture(self, start: int) -> Iterator[None]:
        """Record the router logits of sparse layers >= `start` during the enclosed forward."""
        self.logits = []
        if not self.coef:
            yield
            return
        handles = [block.gate.register_forward_hook(self._record) for i, block in self.blocks.items() if i >= start]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    def _record(self, gate: nn.Module, args: tuple, output: tuple) -> None:
        logits = output[0]
        if logits.grad_fn is None and gate.weight.requires_grad:
            with torch.enable_grad():
                logits = F.linear(args[0].detach().reshape(-1, gate.weight.shape[1]), gate.weight)
        self.logits.append(logits)

    def loss(self, attention_mask: torch.Tensor | None) -> torch.Tensor | float:
        if not self.logits:
            return 0.0
        gate = next(iter(self.blocks.values())).gate
        value = self.function(tuple(self.logits), gate.num_experts, gate.top_k, attention_mask)
        self.logits = []
        return self.coef * value
