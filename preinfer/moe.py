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
from itertools import islice

import torch
import torch.nn.functional as F
from torch import nn
from transformers.integrations.moe import ExpertsInterface

from preinfer.config.choices import EXPERT_PARTS, parse_experts
from preinfer.errors import UsageError

ROW_INVARIANT = "row_invariant"
EXPERTS_IN_ONE_PROCESS = (
    "--experts (expert-granular blocks) runs in one process: each data-parallel replica would choose its experts "
    "from the routing of its own batches and skip the experts its own tokens missed, and the routers' "
    "load-balancing loss is a product of means over the whole batch, not a sum over replicas; drop --experts, or "
    "run one process")
TILE_ROWS = 16


def row_invariant_experts_forward(
    self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """The fused experts' forward as transformers' experts interface defines it (up or gate-up projection with
    its bias, gating or activation, down projection with its bias, an optional post-expert norm, routing weight,
    summed over the top k), every matrix product over tiles of `TILE_ROWS` rows."""
    out = torch.zeros_like(hidden_states)
    hidden = hidden_states.shape[-1]
    gated = getattr(self, "has_gate", True)
    up_name = "gate_up_proj" if gated else "up_proj"
    for expert in top_k_index.unique().tolist():
        if expert >= self.num_experts:
            continue
        token, slot = (top_k_index == expert).nonzero(as_tuple=True)
        rows = len(token)
        tiles = F.pad(hidden_states[token], (0, 0, 0, -rows % TILE_ROWS)).view(-1, TILE_ROWS, hidden)
        up = _tiled_linear(self, tiles, up_name, expert)
        down = _tiled_linear(self, self._apply_gate(up) if gated else self.act_fn(up), "down_proj", expert)
        if getattr(self, "has_post_expert_norm", False):
            down = self.post_expert_norm(down)
        weighted = down.reshape(-1, hidden)[:rows] * top_k_weights[token, slot, None]
        out.index_add_(0, token, weighted.to(out.dtype))
    return out


def _tiled_linear(experts: nn.Module, tiles: torch.Tensor, name: str, expert: int) -> torch.Tensor:
    """Projection `name` of one expert over tiles [N, TILE_ROWS, in], with its bias when the experts have one."""
    weight = getattr(experts, name)[expert]
    weight = weight if getattr(experts, "is_transposed", False) else weight.T
    out = torch.bmm(tiles, weight.expand(len(tiles), -1, -1))
    if getattr(experts, "has_bias", False):
        out = out + getattr(experts, f"{name}_bias")[expert]
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


PARTS = EXPERT_PARTS


def parse_experts_with(text: str) -> frozenset[str]:
    """`router,attention` -> the parts of an expert-granular block that train besides its chosen experts."""
    names = frozenset(n.strip() for n in text.split(",") if n.strip() and n.strip() != "none")
    unknown = sorted(names - set(PARTS))
    if unknown:
        raise UsageError(f"--experts-with '{text}': {', '.join(unknown)} is not one of {', '.join(PARTS)} (or none)")
    return names


def top_experts(counts: torch.Tensor, share: float) -> list[int]:
    """The fewest experts, busiest first, whose routed tokens reach `share` of the layer's (ESFT's rule)."""
    order = torch.argsort(counts, descending=True, stable=True)
    covered = torch.cumsum(counts[order].double(), 0) / counts.sum().clamp_min(1)
    return sorted(order[: int((covered < share - 1e-12).sum()) + 1].tolist())


class ExpertGranular:
    """Expert-granular blocks: within a block's sparse layers, train only the experts that carry the top share of
    the routed tokens, measured on a sample of training batches at the block's first visit.

    The optimizer steps one leaf per chosen expert and fused tensor, a view into the fused [E, ...] parameter's
    storage, so its state covers only the chosen slices and the other experts' slices are never written. As
    backward completes a micro-batch's fused gradient (a hook on the fused tensor), each leaf adds its slice into
    the gradient the visit steps (`ActiveBlock.add_grad`: its fp32 master's under mixed precision; in the step's
    last micro-batch the fused step then steps it) and the fused gradient is freed; an expert that no token
    (padding included) has reached in the step gets no gradient, so the optimizer leaves it and its moments alone.
    `with_parts` trains with them (`router`, `shared` expert and its gate, `attention`, `rest`: norms, dense MLPs,
    embedding and head); the others stay frozen. Without `--experts`, or for a block with no sparse layer, the
    block trains whole.
    """

    def __init__(self, staged, experts: str | None, with_parts: str, sample_batches: int):
        self.staged = staged
        self.share = parse_experts(experts) if experts else None
        self.with_parts = parse_experts_with(with_parts)
        self.sample_batches = sample_batches
        self.sparse = sparse_blocks(staged.layers)
        if self.share is not None and not self.sparse:
            raise UsageError(f"--experts needs a mixture-of-experts model; this {type(staged.model).__name__} "
                             "has no sparse layer")
        self.leaves: list[tuple[nn.Parameter, int, int, torch.Tensor]] = []  # (fused tensor, layer, expert, leaf)
        self.slots: list[int] = []  # each leaf's place among the tensors the visit steps
        self.counts: dict[int, torch.Tensor] = {}
        self.handles: list = []

    def layers(self, block) -> list[int]:
        """The sparse layers of `block` (none: the block trains whole)."""
        if self.share is None:
            return []
        return [i for i in self.sparse if block.start <= i < block.stop]

    @torch.no_grad()
    def measure(self, block, states) -> dict[str, list[int]]:
        """Layer -> chosen experts, from the routing of the first `sample_batches` states (at any boundary up to
        `block.start`) through the block's layers in eval mode (no router jitter); padding positions are not
        counted. Leaves the model in eval mode."""
        self.staged.model.eval()
        layers = self.layers(block)
        counts = {i: torch.zeros(self.sparse[i].gate.num_experts) for i in layers}
        mask = {}

        def count(index):
            def hook(gate, args, output):
                chosen = output[2][mask["real"]].flatten()
                counts[index] += torch.bincount(chosen, minlength=gate.num_experts).cpu().float()
            return hook

        handles = [self.sparse[i].gate.register_forward_hook(count(i)) for i in layers]
        try:
            for state, boundary in islice(states, self.sample_batches):
                mask["real"] = state.attention_mask.flatten()
                self.staged.run(state, boundary, block.stop)
        finally:
            for handle in handles:
                handle.remove()
        return {str(i): top_experts(c, self.share) for i, c in counts.items()}

    def activate(self, block, selection: dict[str, list[int]]) -> list[torch.Tensor]:
        """The tensors the visit's optimizer steps; freezes the parts of `block` that do not train."""
        layers = self.layers(block)
        if not layers:
            return list(block.params)
        parts = self._parts(block)
        trained = []
        for param in block.params:
            part = parts.get(id(param), "rest")
            param.requires_grad_(part == "experts" or part in self.with_parts)
            if part in self.with_parts:
                trained.append(param)
        for index in layers:
            experts = self.sparse[index].experts
            for fused in (p for p in experts.parameters(recurse=False) if p.dim() == 3):
                for expert in selection[str(index)]:
                    leaf = fused.detach()[expert].requires_grad_()
                    self.leaves.append((fused, index, expert, leaf))
                    self.slots.append(len(trained))
                    trained.append(leaf)
            self.counts[index] = torch.zeros(experts.num_experts)
            self.handles.append(self.sparse[index].gate.register_forward_hook(self._count(index)))
        return trained

    def _count(self, index: int):
        def hook(gate, args, output):
            if torch.is_grad_enabled() or gate.training:
                self.counts[index] += torch.bincount(output[2].flatten(), minlength=gate.num_experts).cpu().float()
        return hook

    def _parts(self, block) -> dict[int, str]:
        """id of each parameter of `block`'s sparse layers -> experts, router, shared or attention."""
        parts = {}
        for index in self.layers(block):
            layer, moe = self.staged.layers[index], self.sparse[index]
            groups = {
                "attention": getattr(layer, "self_attn", None),
                "router": moe.gate,
                "shared": [getattr(moe, "shared_expert", None), getattr(moe, "shared_expert_gate", None)],
                "experts": moe.experts,
            }
            for part, modules in groups.items():
                for module in modules if isinstance(modules, list) else [modules]:
                    for param in module.parameters() if module is not None else ():
                        parts[id(param)] = part
        return parts

    def attach(self, active) -> None:
        """Hand each leaf its slice of every micro-batch's fused gradient through `active` (the visit's
        `preinfer.precision.ActiveBlock`, stepping the tensors `activate` returned)."""
        by_fused: dict[int, list[tuple[int, int, int]]] = {}
        for (fused, index, expert, _), slot in zip(self.leaves, self.slots):
            by_fused.setdefault(id(fused), []).append((slot, index, expert))
        for fused in {id(f): f for f, *_ in self.leaves}.values():
            self.handles.append(fused.register_post_accumulate_grad_hook(self._slice(active, by_fused[id(fused)])))

    def _slice(self, active, leaves: list[tuple[int, int, int]]):
        def sliced(fused: torch.Tensor) -> None:
            grad, fused.grad = fused.grad, None
            for slot, index, expert in leaves:
                if self.counts[index][expert] > 0:  # reached by a token of the step so far
                    active.add_grad(slot, grad[expert])
        return sliced

    def before_step(self) -> None:
        """The step's backward is done: its routing counts start again."""
        for counts in self.counts.values():
            counts.zero_()

    def deactivate(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.leaves, self.slots, self.counts, self.handles = [], [], {}, []
