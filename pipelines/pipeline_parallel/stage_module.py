"""One pipeline stage's part of a staged model as the module `PipelineStage` runs: token ids (first stage) or
hidden states in, hidden states (or, on the last stage, what its loss takes: `StagedModel.head_output`, the logits
of the plain loss or the head's features of the chunked one) out.

Side tensors are rebuilt per stage rather than sent: every rank of a replica reads the same batches, so each
stage passes its micro-batch's attention mask as a keyword argument and recomputes the position ids (as
`StagedModel.embed` does) and the causal mask; only hidden states travel between stages.
"""

from __future__ import annotations

import torch
from torch import nn

from preinfer.memory.layer_spans import LayerSpan
from preinfer.partition import Block
from preinfer.staged import StagedModel
from preinfer.boundary_state import BoundaryState


class StageModule(nn.Module):
    """Layers `[stage.start, stage.stop)` of `staged` (the embedding on the first stage, the head on the last);
    from layer `source` on when its input is a store's states at boundary `source` inside the stage.
    With an active block, the embedding (unless the block holds it) and the layers below the block's first run
    under no_grad: they save nothing for backward. Without one (forward only) callers run it under no_grad.
    The staged model is held outside the module's registry: the
    pipeline engine never sees the other stages' (meta-device) parameters."""

    def __init__(self, staged: StagedModel, stage: LayerSpan, active: Block | None = None, recompute: bool = False,
                 source: int = 0):
        super().__init__()
        self._staged = [staged]
        self.stage, self.recompute = stage, recompute
        self.embeds = stage.embed and source == 0  # else its input is hidden states (from below, or a store at `source`)
        self.start = max(stage.start, source)
        self.embed_grad = active is not None and active.has_embed
        self.grad_from = staged.num_layers if active is None else active.start

    @property
    def staged(self) -> StagedModel:
        return self._staged[0]

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        stage, staged = self.stage, self.staged
        if self.embeds:
            with torch.set_grad_enabled(torch.is_grad_enabled() and self.embed_grad):
                state = staged.embed(x, attention_mask)
        else:
            state = BoundaryState.right_padded(x, attention_mask)
        split = min(max(self.grad_from, self.start), stage.stop)
        with torch.no_grad():
            state = staged.run(state, self.start, split)
        state = staged.run(state, split, stage.stop, self.recompute)
        return staged.head_output(state) if stage.head else state.hidden

