"""Batch sources: where a visit's batches come from. Token batches feed the embedding (boundary 0); a store
reader (see `pipelines`) feeds boundary states at some boundary k > 0. Both resume from a `state_dict`."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Protocol

import torch


class BatchSource(Protocol):
    """An endless, resumable stream of training batches (dicts of tensors) at one boundary."""

    boundary: int  # 0: token batches (input_ids, attention_mask, labels); k > 0: boundary states at k

    @property
    def batches_per_epoch(self) -> int: ...

    def __next__(self) -> dict[str, torch.Tensor]: ...

    def one_pass(self) -> Iterator[dict[str, torch.Tensor]]:
        """Every sample once, in a fixed order (evaluation); leaves the training cursor alone."""
        ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


def seeded_permutation(seed: int) -> Callable[[int, int], torch.Tensor]:
    """An order function: (num_samples, epoch) -> a permutation, reshuffled every epoch, fixed by the seed."""

    def order(num_samples: int, epoch: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
        return torch.randperm(num_samples, generator=gen)

    return order


class TokenBatches:
    """Batches of a token dataset (anything indexable by an index tensor into a dict of tensors).

    Each epoch visits every sample once in `order(num_samples, epoch)`; the last batch of an epoch may be
    smaller. With `world_size > 1`, each rank takes a contiguous slice of every global batch.
    """

    boundary = 0

    def __init__(
        self,
        dataset,
        batch_size: int,
        order: Callable[[int, int], torch.Tensor] | None = None,
        rank: int = 0,
        world_size: int = 1,
    ):
        self.dataset = dataset
        self.batch_size = batch_size
        self.order = order or seeded_permutation(0)
        self.rank, self.world_size = rank, world_size
        self.epoch, self.position = 0, 0
        self._perm = self.order(len(dataset), 0)

    @property
    def batches_per_epoch(self) -> int:
        return -(-len(self.dataset) // self.batch_size)

    def __iter__(self) -> TokenBatches:
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        if self.position >= len(self.dataset):
            self.epoch, self.position = self.epoch + 1, 0
            self._perm = self.order(len(self.dataset), self.epoch)
        indices = self._perm[self.position : self.position + self.batch_size]
        self.position += len(indices)
        return self.dataset[self._rank_slice(indices)]

    def one_pass(self) -> Iterator[dict[str, torch.Tensor]]:
        for start in range(0, len(self.dataset), self.batch_size):
            indices = torch.arange(start, min(start + self.batch_size, len(self.dataset)))
            yield self.dataset[self._rank_slice(indices)]

    def _rank_slice(self, indices: torch.Tensor) -> torch.Tensor:
        return indices.tensor_split(self.world_size)[self.rank] if self.world_size > 1 else indices

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.position = state["epoch"], state["position"]
        self._perm = self.order(len(self.dataset), self.epoch)
