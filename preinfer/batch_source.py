"""Batch sources: where a visit's batches come from, and the protocol that chooses them for each visit.

A `BatchSource` streams token batches (boundary 0, feeding the embedding) or boundary states at some boundary
k > 0; `pipelines.data.batches.ReaderBatches` is the one implementation, over a store (`storage`'s reader). A
`VisitSources` picks each visit's (train, eval) sources: `LiveSources` always the same token batches, and
`pipelines.pre_inference.PreInference` stores of boundary states when they pay.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Protocol

import torch

from preinfer.metrics import Record
from preinfer.partition import Block


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


class VisitSources(Protocol):
    """Chooses each visit's batch sources; `pipelines` implements one that trains from stores."""

    def sources(self, block: Block) -> tuple[BatchSource, BatchSource]:
        """(train, eval) sources for a visit of `block`, at a boundary <= block.start."""
        ...

    def visit_finished(self, block: Block) -> None:
        """Called after each visit (e.g. to drop stores the block made stale)."""
        ...

    def sweep_started(self, blocks: list[Block]) -> None:
        """Called before the first visit of each sweep with the blocks it will visit, in order."""
        ...

    def attach(self, emit: Callable[[Record], None]) -> None:
        """Receive the trainer's record writer (metrics.jsonl and progress display)."""
        ...

    def measure_source(self) -> BatchSource:
        """Training batches at the run's lowest boundary, for measurements through every block (the importance
        orders' scores); needed only by one-process runs."""
        ...

    def switch_seconds(self, block: Block) -> float:
        """The seconds a visit of `block` would spend before and beyond training its steps: making its store, or
        running its prefix live (`--stop gain`'s switching cost)."""
        ...


@dataclass
class LiveSources:
    """Every visit reads token batches and runs the frozen prefix live."""

    train: BatchSource
    eval: BatchSource

    def sources(self, block: Block) -> tuple[BatchSource, BatchSource]:
        return self.train, self.eval

    def visit_finished(self, block: Block) -> None:
        pass

    def sweep_started(self, blocks: list[Block]) -> None:
        pass

    def attach(self, emit: Callable[[Record], None]) -> None:
        pass

    def measure_source(self) -> BatchSource:
        return self.train

    def switch_seconds(self, block: Block) -> float:
        """0: every visit runs its prefix live, and no measured rate of the run prices it here."""
        return 0.0
