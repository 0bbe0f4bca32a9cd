"""The boundary state: what layer k needs to continue, as a plain dataclass of tensors."""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from preinfer.errors import BoundaryStateError


@dataclass
class BoundaryState:
    """Hidden states at one boundary plus the per-sample side tensors the layers and the loss need.

    `attention_mask` is bool `[B, T]` (True at real tokens; right padding), `position_ids` int64 `[B, T]`,
    `labels` int64 `[B, T]` in the Hugging Face convention (unshifted, -100 ignored) or None.
    Rotary tables and causal masks are recomputed from these, never carried.
    """

    hidden: torch.Tensor
    attention_mask: torch.Tensor
    position_ids: torch.Tensor
    labels: torch.Tensor | None = None

    def __len__(self) -> int:
        return self.hidden.shape[0]

    def __getitem__(self, index) -> BoundaryState:
        """Select samples (an int, a slice or an index tensor); the sample axis is kept."""
        if isinstance(index, int):
            index = slice(index, index + 1)
        return BoundaryState(**{k: None if v is None else v[index] for k, v in self._items()})

    def to_dict(self) -> dict[str, torch.Tensor]:
        return {k: v for k, v in self._items() if v is not None}

    @classmethod
    def right_padded(cls, hidden: torch.Tensor, attention_mask: torch.Tensor,
                     labels: torch.Tensor | None = None) -> BoundaryState:
        """The state of a right-padded batch's hidden states `[B, T, H]`: positions 0..T-1 in every row (what the
        embedding gives them; a stage that receives hidden states rebuilds them the same way)."""
        batch, length = attention_mask.shape
        positions = torch.arange(length, device=hidden.device).expand(batch, length)
        return cls(hidden, attention_mask.bool(), positions, labels)

    def shared_positions(self) -> torch.Tensor:
        """`position_ids`, as one row `[1, T]` when every row shares it by construction (`right_padded`'s
        stride-0 expand), so that rotary tables are built and saved for backward once, not once per row."""
        positions = self.position_ids
        return positions[:1] if positions.dim() == 2 and positions.stride(0) == 0 else positions

    @classmethod
    def from_dict(cls, tensors: dict[str, torch.Tensor]) -> BoundaryState:
        names = {f.name for f in fields(cls)}
        unknown = set(tensors) - names
        if unknown:
            raise BoundaryStateError(f"unknown boundary-state fields {sorted(unknown)}; expected {sorted(names)}")
        return cls(**tensors)

    def to(self, device: torch.device | str, non_blocking: bool = False) -> BoundaryState:
        return BoundaryState(
            **{k: None if v is None else v.to(device, non_blocking=non_blocking) for k, v in self._items()}
        )

    def _items(self):
        return ((f.name, getattr(self, f.name)) for f in fields(self))
