"""Landscape expansion over the suffix (BREAD, NeurIPS 2025): during a visit, the decoder layers above the active
block get a cheap update at every step from the gradients its backward already runs through them.

`--expand auto`, the default, is lowrank where it runs (`expansion_of`: a dense model's BCD run without --active,
--experts or --keep-optimizer-state, with any --frozen-dtype; on a pipeline too) and none elsewhere; bench.finetune
measured it better than none on both SmolLM2 corpora and seeds (docs/results.md, "BCD's levers on SmolLM2").

`--expand lowrank` (`LowRankExpansion`): each linear weight W [out, in] of a suffix layer gets rank-r fp32 factors
A [r, in] (drawn from N(0, 1/in) by a generator seeded with the run's seed, the step the visit starts at and
the block, so a resumed run draws what the uninterrupted one drew and the run's own random state is not touched)
and B [out, r] (zeros, so the model is unchanged when the visit starts), added to the layer's output by a forward hook: y = W x + B (A x). `activate` returns them, so
the visit's optimizer steps them with the block (at `--expand-lr` in a group of their own when it is given, else in
the block's; on the visit's schedule either way), clipping covers them and the data-parallel reducer sums their
gradients like the block's. When the visit ends, B A is added into W (in fp32, cast to W's dtype) and the factors
and hooks are removed. A mid-visit checkpoint carries the factors with the visit's masters
(`VisitLifecycle.checkpointed`).

`--expand sgd` (`SgdExpansion`): every parameter of the suffix layers takes a gradient for the visit; after each
optimizer step it gets a plain SGD step, w <- w - lr g (in fp32, cast to w's dtype; summed over the data-parallel
replicas first), at the constant rate `--expand-lr`, and the gradient is dropped. It keeps no state.

On a pipeline each stage expands the suffix layers it holds: the factors are drawn in one process's order (a
stage draws, then drops, the others'), and each stage's visit optimizer steps its own.

On layers held in fewer bits (`--frozen-dtype`, `preinfer.frozen_weights.FrozenWeight`) both write the master, as
QLoRA's adapters sit beside NF4 weights: lowrank's factors sit beside the codes (made on the run's device) and its
merge adds B A into the layer's master, whose codes are then built from it again; sgd's gradient of a frozen
weight is grad^T x taken through the codes (the straight-through gradient of the weight the forward ran), on the
master's device, and its step writes the master and rebuilds the codes (on an accelerator, a weight's transfer
each way per step). Nothing is quantized from codes, and the export holds masters only.

Only the decoder layers `[block.stop, num_layers)` change: the embedding and the head are trained only by the
blocks the partition gives them (a head-holding block has no suffix). The layers below the active block never
change, so every store at a boundary at or below `block.start` stays valid in every order; a store above it is
made stale by the visit's own block already (its fingerprint, a hash of its prefix's tensors, changes with them).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from transformers.pytorch_utils import Conv1D

from preinfer.config import Config
from preinfer.config.rules import resolved_expand
from preinfer.moe import sparse_blocks
from preinfer.optim import resolved_lr
from preinfer.partition import Block
from preinfer.staged import StagedModel


def sum_over_world(tensor: torch.Tensor) -> None:
    """Sum `tensor` in place over every process of torchrun's group (nothing in one process)."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(tensor)


def suffix_layers(staged: StagedModel, block: Block) -> list[nn.Module]:
    """The decoder layers above `block`: those its visit expands."""
    return list(staged.layers[block.stop:])


def linear_weights(layers: list[nn.Module]) -> Iterator[tuple[nn.Module, bool]]:
    """Each linear module of `layers` (nn.Linear, and transformers' Conv1D, whose weight is stored transposed), in
    module order, with whether its weight is [in, out]."""
    for layer in layers:
        for module in layer.modules():
            if isinstance(module, (nn.Linear, Conv1D)):
                yield module, isinstance(module, Conv1D)


class Factors:
    """One linear module's rank-r factors, on `device` (where the module computes), and the forward hook that adds
    their product to its output."""

    def __init__(self, module: nn.Module, transposed: bool, rank: int, lr: float | None, gen: torch.Generator,
                 device: torch.device | str):
        self.module, self.transposed = module, transposed
        out_features, in_features = module.weight.shape[::-1] if transposed else module.weight.shape
        rank = min(rank, out_features, in_features)  # a higher rank is full rank already there
        self.a = nn.Parameter(torch.randn(rank, in_features, generator=gen).div_(in_features ** 0.5).to(device))
        self.b = nn.Parameter(torch.zeros(out_features, rank, device=device))
        if lr is not None:
            for factor in (self.a, self.b):
                factor.visit_lr = lr  # the rate of a group of its own (preinfer.visit_optimizer)
        self.handle = module.register_forward_hook(self._add)

    def _add(self, module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
        x = args[0]
        return output + F.linear(F.linear(x, self.a.to(x.dtype)), self.b.to(x.dtype))

    def dense(self) -> torch.Tensor:
        """The update of the module's weight the factors stand for, in fp32 and the weight's own layout."""
        delta = self.b.detach() @ self.a.detach()
        return delta.t() if self.transposed else delta

    @torch.no_grad()
    def merge(self) -> None:
        """Add the dense update into the weight (where it is: a frozen weight's master, whose codes are then built
        from it again) and remove the hook."""
        weight = self.module.weight
        weight.copy_(weight.float() + self.dense().to(weight.device))
        self.handle.remove()


def widest_rank(staged: StagedModel) -> int | None:
    """The widest narrow side (rows or columns) of the layers' linear weights: the largest rank a low-rank update
    of any of them can have (each weight's factors are at most its full rank: a shared expert's gate of one row
    gets rank 1); None without a linear weight. The rank's bound (`preinfer.config.resolved.check_resolved`)."""
    return max((min(module.weight.shape) for module, _ in linear_weights(list(staged.layers))), default=None)


class LowRankExpansion:
    """`--expand lowrank` (see the module's docstring)."""

    def __init__(self, staged: StagedModel, rank: int, lr: float | None, seed: int = 0,
                 step: Callable[[], int] = lambda: 0, device: torch.device | str = "cpu"):
        """`step`: the run's global step now (the factors of a visit are drawn from it, the seed and the block);
        `device`: the run's, where the factors are made; each linear's factors have at most its full rank (the
        run's rules bound `rank` by `widest_rank`)."""
        self.staged, self.rank, self.lr, self.seed, self.step = staged, rank, lr, seed, step
        self.device = torch.device(device)
        self.factors: list[Factors] = []

    def activate(self, block: Block) -> list[nn.Parameter]:
        """Factors of the suffix's linears this process holds (a pipeline stage's other layers are on the meta
        device), each drawn where one process would draw it."""
        layers = suffix_layers(self.staged, block)
        gen = torch.Generator().manual_seed(visit_seed(self.seed, self.step(), block.index))
        drawn = [Factors(module, transposed, self.rank, self.lr, gen, "meta" if module.weight.is_meta else self.device)
                 for module, transposed in linear_weights(layers)]
        for unheld in (f for f in drawn if f.module.weight.is_meta):
            unheld.handle.remove()
        self.factors = [f for f in drawn if not f.module.weight.is_meta]
        return [factor for f in self.factors for factor in (f.a, f.b)]

    def after_step(self) -> None:
        pass

    def deactivate(self, block: Block) -> None:
        for factors in self.factors:
            factors.merge()
        self.factors = []


class SgdExpansion:
    """`--expand sgd` (see the module's docstring)."""

    def __init__(self, staged: StagedModel, lr: float,
                 sum_over_replicas: Callable[[torch.Tensor], None] = sum_over_world,
                 device: torch.device | str = "cpu"):
        """`sum_over_replicas`: sums a gradient in place over the data-parallel replicas (the trainer's seams';
        by default over every process of torchrun's group); `device`: the run's, where the sum runs."""
        self.staged, self.lr, self.sum_over_replicas = staged, lr, sum_over_replicas
        self.device = torch.device(device)
        self.params: list[nn.Parameter] = []

    def activate(self, block: Block) -> list[nn.Parameter]:
        """The suffix's parameters this process holds (not a pipeline stage's others, on the meta device)."""
        self.params = [p for layer in suffix_layers(self.staged, block) for p in layer.parameters()
                       if p.is_floating_point() and not p.is_meta]
        for param in self.params:
            param.requires_grad_(True)
        return []

    @torch.no_grad()
    def after_step(self) -> None:
        for param in self.params:
            if param.grad is None:
                continue
            grad = param.grad.to(self.device)  # itself, but for a frozen weight's (on its host master)
            self.sum_over_replicas(grad)
            param.copy_(param.float() - self.lr * grad.float().to(param.device))
            param.grad = None

    def deactivate(self, block: Block) -> None:
        for param in self.params:
            param.requires_grad_(False)
            param.grad = None
        self.params = []


def visit_seed(seed: int, step: int, block: int) -> int:
    """The seed of the factors of block `block`'s visit starting at global step `step` of a run seeded `seed`."""
    return int.from_bytes(hashlib.sha256(f"expand/{seed}/{step}/{block}".encode()).digest()[:8], "little")


def expansion_of(staged: StagedModel, config: Config) -> str:
    """The expansion a run of `staged` with `config` makes: [blocks] expand, auto resolved by `resolved_expand`
    (none on a mixture-of-experts model)."""
    return resolved_expand(config, sparse=bool(sparse_blocks(staged.layers)))


def expansion_hooks(staged: StagedModel, config: Config, step: Callable[[], int],
                    sum_over_replicas: Callable[[torch.Tensor], None] = sum_over_world,
                    ) -> list[LowRankExpansion | SgdExpansion]:
    """The visit hooks of the run's expansion (`expansion_of`; none: no hook); `step`: the run's global step now;
    `sum_over_replicas`: the seams' sum of a tensor over the data-parallel replicas."""
    b, expand = config.blocks, expansion_of(staged, config)
    if expand == "lowrank":
        return [LowRankExpansion(staged, b.expand_rank, b.expand_lr, config.run.seed, step, config.run.device)]
    if expand == "sgd":
        lr = b.expand_lr if b.expand_lr is not None else resolved_lr(config.optim)
        return [SgdExpansion(staged, lr, sum_over_replicas, config.run.device)]
    return []
