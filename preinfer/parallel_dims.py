"""The run's parallelism, built once: its degrees and the device mesh over them (as torchtitan's `ParallelDims`).

A run has `data` data-parallel replicas of a `pipeline` of stages (and room for `experts`, an expert-parallel
degree, 1 until it is built): world size = data x pipeline x experts, rank = replica x pipeline + stage, so each
replica's stages are consecutive ranks. `parallel_dims` builds it from torchrun's process group, once per run;
everything that asks how many processes share a step, which one this is, or which group to talk over reads it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from preinfer.errors import UsageError


@dataclass(frozen=True)
class ParallelDims:
    """The degrees, this rank's place among them, and the groups it talks over."""

    data: int = 1  # data-parallel replicas
    pipeline: int = 1  # pipeline stages
    experts: int = 1  # expert-parallel groups (not built yet: always 1)
    rank: int = 0
    mesh: DeviceMesh | None = None  # ("data",), or ("data", "pipe") with a pipeline; None in one process
    tails: Mapping[int, dist.ProcessGroup] = field(default_factory=dict)  # s -> this replica's stages s..N-1

    @property
    def world(self) -> int:
        return self.data * self.pipeline * self.experts

    @property
    def stage(self) -> int:
        return self.rank % self.pipeline

    @property
    def replica(self) -> int:
        return self.rank // self.pipeline

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.pipeline - 1

    def rank_of(self, stage: int) -> int:
        """Global rank of `stage` in this rank's replica."""
        return self.replica * self.pipeline + stage

    @property
    def data_group(self) -> dist.ProcessGroup | None:
        """The ranks holding this stage in every replica (None with one replica)."""
        return self.mesh.get_group("data") if self.mesh is not None and self.data > 1 else None

    @property
    def pipe_group(self) -> dist.ProcessGroup:
        """This replica's stages (a pipeline's only)."""
        return self.tails[0]


def check_degrees(pipeline: int, world: int) -> int:
    """The number of data-parallel replicas; a UsageError when `pipeline` does not divide the world size."""
    if world % pipeline:
        raise UsageError(f"--pipeline {pipeline} does not divide the world size {world}: run under "
                         f"`torchrun --nproc-per-node {pipeline}` (or a multiple of {pipeline})")
    return world // pipeline


def parallel_dims(pipeline: int, device: str) -> ParallelDims:
    """The dims of the initialised process group (one process when there is none) with `pipeline` stages, and
    their mesh; every rank creates every group, in the same order."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        check_degrees(pipeline, 1)
        return ParallelDims()
    world, rank = dist.get_world_size(), dist.get_rank()
    data = check_degrees(pipeline, world)
    kind = "cuda" if device.startswith("cuda") else "cpu"
    if pipeline == 1:  # one dimension spanning the world: the default group
        return ParallelDims(data, 1, 1, rank, init_device_mesh(kind, (data,), mesh_dim_names=("data",)))
    mesh = init_device_mesh(kind, (data, pipeline), mesh_dim_names=("data", "pipe"))
    replica = rank // pipeline
    tails: dict[int, dist.ProcessGroup] = {0: mesh.get_group("pipe")}
    for start in range(1, pipeline):
        for other in range(data):
            group = dist.new_group([other * pipeline + j for j in range(start, pipeline)])
            if other == replica:
                tails[start] = group
    return ParallelDims(data, pipeline, 1, rank, mesh, tails)
