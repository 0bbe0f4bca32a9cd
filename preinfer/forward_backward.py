"""One micro-batch's forward and backward in one process, and the boundary state a batch stands for.

The frozen layers up to the active block run under `no_grad` (they save nothing for backward), the active block
and everything above it with autograd (with `recompute`, each of those layers keeps only its input and runs again
in backward). Backward stops at the active block because its input carries no graph.
"""

from __future__ import annotations

import torch

from preinfer.boundary_state import BoundaryState
from preinfer.errors import PreinferError
from preinfer.moe import RouterLoss
from preinfer.partition import Block
from preinfer.staged import StagedModel


def forward_backward(staged: StagedModel, batch: dict, block: Block, boundary: int, count: torch.Tensor,
                     scale_loss, router_loss: RouterLoss, router_share: int, recompute: bool) -> float:
    """One micro-batch (at `boundary`) from the active block's input to the loss, and backward from
    `scale_loss(loss)`; the loss is the micro-batch's share of the mean over the `count` supervised tokens of the
    global batch, plus its `1 / router_share` of the routers' loss. Returns the loss."""
    state = input_state(staged, batch, block, boundary)
    with router_loss.capture(block.start):
        out = staged.run(state, block.start, staged.num_layers, recompute)
    loss = micro_batch_loss(staged, out, count, router_loss, router_share)
    scale_loss(loss).backward()
    return loss.item()


def micro_batch_loss(staged: StagedModel, out: BoundaryState, count: torch.Tensor, router_loss: RouterLoss,
                     router_share: int) -> torch.Tensor:
    """A final state's loss: its share of the mean over the `count` supervised tokens of the global batch, plus
    its `1 / router_share` of the routers' loss (over the logits `router_loss` recorded)."""
    loss = staged.loss_sum(out) / count
    return loss + router_loss.loss(out.attention_mask) / router_share


def input_state(staged: StagedModel, batch: dict, block: Block, boundary: int) -> BoundaryState:
    """The state at `block.start`: embedded with autograd if the block holds the embedding, else computed from
    the batch's boundary under no_grad (nothing below the active block is saved for backward)."""
    if boundary > block.start:
        raise PreinferError(f"a source at boundary {boundary} cannot feed block {block.index} "
                            f"(it starts at boundary {block.start})")
    if boundary == 0 and block.has_embed:
        return staged.embed(batch["input_ids"], batch["attention_mask"], batch["labels"])
    with torch.no_grad():
        state = batch_state(staged, batch, boundary)
        return staged.run(state, boundary, block.start)


def batch_state(staged: StagedModel, batch: dict[str, torch.Tensor], boundary: int) -> BoundaryState:
    """The boundary state a batch stands for: token batches are embedded, stored states cast to the model's
    compute dtype."""
    if boundary == 0:
        return staged.embed(batch["input_ids"], batch["attention_mask"], batch["labels"])
    state = BoundaryState.from_dict(batch)
    state.hidden = state.hidden.to(staged.compute_dtype)
    return state


def to_device(batch: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}
