"""Parameter counts of a model's parts measured on its own code: the model built on the meta device (no memory)
and staged, for the planner's shapes of families its formulas do not describe."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM

from preinfer.moe import sparse_blocks
from preinfer.families import stage


def counted_parameters(config) -> dict:
    """The ModelShape fields `counted_layers`, `counted_expert`, `counted_embed`, `counted_head` of `config`'s
    causal LM (a tied weight counted once, on the embedding side)."""
    with torch.device("meta"):
        staged = stage(AutoModelForCausalLM.from_config(config))
    embed = _count(staged.embed_modules(), set())
    seen = {id(p) for m in staged.embed_modules() for p in m.parameters()}
    blocks = sparse_blocks(staged.layers)
    expert = next((sum(p.numel() for p in b.experts.parameters()) // b.gate.num_experts for b in blocks.values()), 0)
    return dict(counted_layers=tuple(_count([layer], set()) for layer in staged.layers), counted_expert=expert,
                counted_embed=embed, counted_head=_count(staged.head_modules(), seen))


def _count(modules, seen: set[int]) -> int:
    total = 0
    for module in modules:
        for p in module.parameters():
            if id(p) not in seen:
                seen.add(id(p))
                total += p.numel()
    return total
