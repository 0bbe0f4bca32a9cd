"""The seams of a parallel layout: what the trainer asks of wherever the model lives.

`preinfer.trainer.Trainer` runs the same sweeps, visits, stopping rules, records and checkpoints whatever the
layout; a `Layout` does the parts that depend on where the weights are and how many processes share a step:

seam                           one process        data parallel          a pipeline stage (`StageLayout`)
trained(block)                 the block          the block              the part the stage holds and owns
activate / deactivate          -                  gradient buckets       the visit's pipeline, tied-weight hooks
fetch                          grad_accum batches this rank's share      none below the visit's store
forward_backward               micro-batches      the same, buckets out  each batch through the stages
sum_over_replicas / reduce     -                  all-reduce             all-reduce over the stage's replicas
combine                        -                  loss over ranks        loss over stages and replicas
clip                           clip_grad_norm_    the same               the norm over every stage
after_update / zero_grad       -                  -                      the tied weight's values and gradient
shared_cursor                  the cursor         the cursor             the cursor of the stage the store fed
eval_sums                      the model          the model              through the stages, sums shared
rank_memory                    None               None                   every rank's peaks
stop_agreed                    the request        any rank's             any rank's
checkpoint_dir / save / load   checkpoint/        rank 0 writes          checkpoint/stage-J/, weights gathered

`SingleProcess` and `DataParallel` are here; `StageLayout` is `pipelines.pipeline_parallel.stage`'s.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

import torch
import torch.distributed as dist
from torch import nn

from preinfer.batch_source import BatchSource
from preinfer.checkpoint import Checkpoint, load_checkpoint, save_checkpoint
from preinfer.config import Config
from preinfer.evaluation import eval_sums
from preinfer.forward_backward import forward_backward, to_device
from preinfer.grad_buckets import BucketedAllReduce
from preinfer.layer_major import layer_major
from preinfer.moe import RouterLoss
from preinfer.partition import Block
from preinfer.run_dir import RunDir
from preinfer.staged import StagedModel
from preinfer.visit_optimizer import VisitOptimizer, clip_norm


class Layout(Protocol):
    """Where the model lives, as the trainer asks (see the module's table)."""

    rank: int
    world_size: int

    def trained(self, block: Block) -> list[nn.Parameter]:
        """The parameters of `block` this process steps."""
        ...

    def activate(self, block: Block, boundary: int, visit: VisitOptimizer) -> None:
        """A visit of `block` from batches at `boundary` starts, stepped by `visit`."""
        ...

    def fetch(self, train: BatchSource, count: int) -> list[dict]:
        """The step's `count` micro-batches, on the device."""
        ...

    def sum_over_replicas(self, tensor: torch.Tensor) -> None:
        """Sum `tensor` in place over the data-parallel replicas."""
        ...

    def forward_backward(self, batches: list[dict], block: Block, boundary: int, count: torch.Tensor,
                         visit: VisitOptimizer) -> tuple[float, int]:
        """Forward and backward of every micro-batch, their gradients accumulating; returns the sum of their
        losses (each a share of the mean over the `count` supervised tokens of the global batch) and their real
        tokens."""
        ...

    def reduce(self) -> None:
        """The step's gradients summed over the replicas (after `forward_backward`)."""
        ...

    def combine(self, total: float, tokens: int) -> tuple[float, int]:
        """The step's loss over every rank, and this process's tokens."""
        ...

    def clip(self, tensors: list[torch.Tensor], max_norm: float) -> None:
        """Clip the gradient norm of the active block (`tensors`: this process's part of it)."""
        ...

    def after_update(self) -> None:
        """After the optimizer stepped and the masters were cast down."""
        ...

    def zero_grad(self) -> None:
        """Gradients beyond the optimizer's own, dropped after each step."""
        ...

    def shared_cursor(self, cursor: dict | None) -> dict | None:
        """The data cursor the next visit reads on from (every process the same)."""
        ...

    def deactivate(self) -> None:
        """The visit ended."""
        ...

    def eval_sums(self, source: BatchSource) -> tuple[float, int]:
        """(summed loss, supervised tokens) of the source's eval pass, the same on every process."""
        ...

    def rank_memory(self, memory: dict[str, int]) -> list[dict] | None:
        """Every rank's memory peaks of the visit (a visit record's `ranks`), or None."""
        ...

    def stop_agreed(self, requested: bool) -> bool:
        """Whether any process was asked to stop (every process stops at the same step)."""
        ...

    def checkpoint_dir(self, run_dir: RunDir) -> Path:
        """The directory of this process's checkpoint."""
        ...

    def save(self, run_dir: RunDir, model: nn.Module, optimizers: dict[int, dict], trainer_state: dict,
             masters: list[torch.Tensor]) -> None:
        ...

    def load(self, run_dir: RunDir, model: nn.Module) -> Checkpoint:
        ...


class SingleProcess:
    """The whole model (or the suffix above a store) in one process; with `stream` (`--stream-frozen`: a
    `preinfer.stream_frozen.LayerStream`) each step runs layer-major (`preinfer.layer_major`)."""

    rank, world_size = 0, 1
    stream = None

    def __init__(self, staged: StagedModel, config: Config):
        self.staged, self.config = staged, config
        self.device = torch.device(config.run.device)
        self.router_loss = RouterLoss(staged.model, staged.layers)

    def trained(self, block: Block) -> list[nn.Parameter]:
        return list(block.params)

    def activate(self, block: Block, boundary: int, visit: VisitOptimizer) -> None:
        pass

    def fetch(self, train: BatchSource, count: int) -> list[dict]:
        return [to_device(next(train), self.device) for _ in range(count)]

    def sum_over_replicas(self, tensor: torch.Tensor) -> None:
        pass

    def forward_backward(self, batches: list[dict], block: Block, boundary: int, count: torch.Tensor,
                         visit: VisitOptimizer) -> tuple[float, int]:
        total, tokens = 0.0, 0
        share = self.config.optim.grad_accum * self.world_size
        if self.stream is not None:
            total = layer_major(self.staged, batches, block, boundary, count, visit, self.router_loss, share,
                                self.config.run.recompute, self.stream)
            return total, sum(int(batch["attention_mask"].sum()) for batch in batches)
        for index, batch in enumerate(batches):
            visit.active.last_micro_batch = index == len(batches) - 1
            total += forward_backward(self.staged, batch, block, boundary, count, visit.scale_loss,
                                      self.router_loss, share, self.config.run.recompute)
            tokens += int(batch["attention_mask"].sum())
        return total, tokens

    def reduce(self) -> None:
        pass

    def combine(self, total: float, tokens: int) -> tuple[float, int]:
        return total, tokens

    def clip(self, tensors: list[torch.Tensor], max_norm: float) -> None:
        clip_norm(tensors, max_norm)

    def after_update(self) -> None:
        pass

    def zero_grad(self) -> None:
        pass

    def shared_cursor(self, cursor: dict | None) -> dict | None:
        return cursor

    def deactivate(self) -> None:
        pass

    def eval_sums(self, source: BatchSource) -> tuple[float, int]:
        return eval_sums(self.staged, source, self.device)

    def rank_memory(self, memory: dict[str, int]) -> list[dict] | None:
        return None

    def stop_agreed(self, requested: bool) -> bool:
        return requested

    def checkpoint_dir(self, run_dir: RunDir) -> Path:
        return run_dir.checkpoint

    def save(self, run_dir: RunDir, model: nn.Module, optimizers: dict[int, dict], trainer_state: dict,
             masters: list[torch.Tensor]) -> None:
        if self.rank == 0:
            save_checkpoint(run_dir.checkpoint, model, optimizers, trainer_state, masters)

    def load(self, run_dir: RunDir, model: nn.Module) -> Checkpoint:
        return load_checkpoint(run_dir.checkpoint, model)


class DataParallel(SingleProcess):
    """The whole model in every process of torchrun's group, each a replica reading its share of every batch; the
    active block's gradients are summed in buckets launched as backward completes them (`BucketedAllReduce`), and
    the fused step steps each tensor once its bucket's sum is back."""

    def __init__(self, staged: StagedModel, config: Config):
        super().__init__(staged, config)
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.reducer: BucketedAllReduce | None = None

    def activate(self, block: Block, boundary: int, visit: VisitOptimizer) -> None:
        """The visit's buckets; the fused step, watching the block until now, steps each tensor once it is summed."""
        self.reducer = BucketedAllReduce(visit.active.masters)
        self.reducer.on_reduced = visit.active.watch(self.reducer.grad_ready)

    def sum_over_replicas(self, tensor: torch.Tensor) -> None:
        dist.all_reduce(tensor)

    def reduce(self) -> None:
        """Wait for the buckets, write the sums into the gradients, and expect the next step's."""
        self.reducer.finish()
        self.reducer.start_step()

    def combine(self, total: float, tokens: int) -> tuple[float, int]:
        summed = torch.tensor(total, device=self.device)
        dist.all_reduce(summed)
        return summed.item(), tokens

    def deactivate(self) -> None:
        self.reducer = None

    def stop_agreed(self, requested: bool) -> bool:
        return any_rank(requested, self.device)

    def load(self, run_dir: RunDir, model: nn.Module) -> Checkpoint:
        """Rank 0's checkpoint, its data cursor made this replica's: every replica has read as many batches of its
        own share of the data, so its reader stands where rank 0's does, with its own rank."""
        checkpoint = super().load(run_dir, model)
        cursor = checkpoint.trainer.get("cursor")
        if isinstance(cursor, dict) and "rank" in cursor:
            checkpoint.trainer["cursor"] = {**cursor, "rank": self.rank}
        return checkpoint


def any_rank(flag: bool, device: torch.device) -> bool:
    """Whether `flag` is set on any rank of the default group."""
    summed = torch.tensor(float(flag), device=device)
    dist.all_reduce(summed, op=dist.ReduceOp.MAX)
    return bool(summed.item())


def replica_layout(staged: StagedModel, config: Config) -> SingleProcess:
    """One process, or a data-parallel replica under torchrun."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        return DataParallel(staged, config)
    return SingleProcess(staged, config)
