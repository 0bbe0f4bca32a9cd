"""The 2-D process mesh of a pipeline run: D data-parallel replicas of an N-stage pipeline, rank = replica x N +
stage, so each replica's stages are consecutive ranks."""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from preinfer.errors import UsageError


@dataclass
class PipelineMesh:
    """This rank's place in the mesh and the groups it talks over."""

    stages: int  # N
    replicas: int  # D
    stage: int  # this rank's stage index
    replica: int  # this rank's replica index
    mesh: DeviceMesh | None  # ("data", "pipe"); None in one process
    tails: dict[int, dist.ProcessGroup]  # s -> this replica's stages s..N-1 (the pipeline a visit trains on)

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.stages - 1

    def rank_of(self, stage: int) -> int:
        """Global rank of `stage` in this rank's replica."""
        return self.replica * self.stages + stage

    @property
    def data_group(self) -> dist.ProcessGroup | None:
        """The ranks holding this stage in every replica (None with one replica)."""
        return self.mesh.get_group("data") if self.mesh is not None and self.replicas > 1 else None

    @property
    def pipe_group(self) -> dist.ProcessGroup:
        return self.tails[0]


def check_degree(stages: int, world: int) -> int:
    """The number of data-parallel replicas; a UsageError when `stages` does not divide the world size."""
    if world % stages:
        raise UsageError(f"--pipeline {stages} does not divide the world size {world}: run under "
                         f"`torchrun --nproc-per-node {stages}` (or a multiple of {stages})")
    return world // stages


def make_mesh(stages: int, device: str) -> PipelineMesh:
    """The mesh of an initialised process group; every rank creates every group, in the same order."""
    world, rank = dist.get_world_size(), dist.get_rank()
    replicas = check_degree(stages, world)
    mesh = init_device_mesh("cuda" if device.startswith("cuda") else "cpu", (replicas, stages),
                            mesh_dim_names=("data", "pipe"))
    stage, replica = rank % stages, rank // stages
    tails: dict[int, dist.ProcessGroup] = {0: mesh.get_group("pipe")}
    for start in range(1, stages):
        for other in range(replicas):
            group = dist.new_group([other * stages + j for j in range(start, stages)])
            if other == replica:
                tails[start] = group
    return PipelineMesh(stages, replicas, stage, replica, mesh, tails)
