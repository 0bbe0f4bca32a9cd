"""How the processes of a run make a store of boundary states: the strategy pre-inference is given
(`StoreWriter`), what making one measured (`Built`), and the writer of a run that holds the whole model in each
process (`LocalWriter`: one process, or data-parallel replicas). A pipeline's writer, whose stages make each store
together, is `pipelines.pre_inference.stage_writer.StageWriter`."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Protocol

import torch.distributed as dist

from preinfer.fingerprint import prefix_digest
from preinfer.partition import Block
from preinfer.staged import StagedModel
from pipelines.cache import CacheOptions, CacheResult, Part, cache_boundary, roll_forward
from storage import Location


@dataclass(frozen=True)
class Built:
    """What making one store measured, the same in every process that took part: the caching job's `CacheResult`
    in the numbers pre-inference keeps (`samples_computed`: those this process's share computed)."""

    boundary: int
    seconds: float
    forward_seconds: float
    write_seconds: float
    samples_computed: int
    stored_bytes: int

    @classmethod
    def of(cls, result: CacheResult) -> Built:
        return cls(result.boundary, result.seconds, result.forward_seconds, result.write_seconds,
                   result.samples_computed, result.stored_bytes)


class StoreWriter(Protocol):
    """How the processes of a run make a store together. Every process calls each method at the same point of
    the run (a writer may meet the others in collectives)."""

    parts: int  # processes that each compute and write a share of every store (`sweep_plan.Workload.ranks`)
    rolls_forward: bool  # whether a store can be made from a lower one (else: from the input only)

    def prefix_digest(self, boundary: int) -> str:
        """The digest of the weights below `boundary`, which a store's fingerprint records."""
        ...

    def write(self, boundary: int, source: Location | None, out: Location, options: CacheOptions) -> Built:
        """Make the store at `boundary` under `out`: from the input, or rolled forward from the store at
        `source`."""
        ...

    def reading(self, block: Block, boundary: int) -> None:
        """A visit of `block` is about to read the store at `boundary`."""
        ...


class LocalWriter:
    """The whole model in this process: the caching job (`cache_boundary`, `roll_forward`) makes each store here;
    under data parallelism each of the `world` ranks computes and writes its share of it."""

    rolls_forward = True

    def __init__(self, staged: StagedModel, datasets: dict, tokenizer, rank: int = 0, world: int = 1):
        self.staged, self.datasets, self.tokenizer = staged, datasets, tokenizer
        self.parts = world
        self.part = Part(rank, world, dist.barrier) if world > 1 else None

    def prefix_digest(self, boundary: int) -> str:
        return prefix_digest(self.staged, boundary)

    def write(self, boundary: int, source: Location | None, out: Location, options: CacheOptions) -> Built:
        """The prefix runs as the model holds it (layers held in fewer bits from their codes, as a live visit runs
        them), so training from the store equals training live."""
        if self.part is not None:
            options = dataclasses.replace(options, part=self.part)
        if source is not None:
            return Built.of(roll_forward(self.staged, source, boundary, out, options))
        return Built.of(cache_boundary(self.staged, self.datasets, self.tokenizer, boundary, out, options))

    def reading(self, block: Block, boundary: int) -> None:
        """Nothing to say: the process runs the visit whole."""
