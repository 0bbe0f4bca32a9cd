"""The step's seams: what the trainer asks of wherever the model lives.

`preinfer.trainer.Trainer` runs the same sweeps, visits, stopping rules, records and checkpoints wherever the
model lives; its `Seams` do the parts that depend on where the weights are and how many processes share a step
(the degrees and groups are the run's `preinfer.parallel_dims.ParallelDims`):

seam                           one process        data parallel          a pipeline stage (`StageSeams`)
trained(block)                 the block          the block              the part the stage holds and owns
activate / deactivate          -                  buckets; visit's avg   the visit's pipeline, tied-weight hooks
fetch                          grad_accum batches this rank's share      none below the visit's store
forward_backward               micro-batches      the same, buckets out  each batch through the stages
sum_over_replicas / reduce     -                  all-reduce (step sync) all-reduce over the stage's replicas
combine                        -                  loss over replicas     loss over stages and replicas
clip                           clip_grad_norm_    the same               the norm over every stage
after_update / end_step        -                  every:N's average      the tied weight's values and gradient
shared_cursor                  the cursor         the cursor             the cursor of the stage the store fed
eval_sums                      the model          the model              through the stages, sums shared
rank_memory                    None               None                   every rank's peaks
stop_agreed                    the request        any rank's             any rank's
checkpoint_dir / save / load   checkpoint/        each replica its own   checkpoint/stage-J/, weights gathered
wire                           None               the bytes sent         the bytes sent over the replicas

`SingleProcess` and `DataParallel` are here; `StageSeams` is `pipelines.pipeline_parallel.stage`'s.
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
from preinfer.config.sync_rules import parse_dp_sync
from preinfer.errors import PreinferError
from preinfer.evaluation import eval_sums
from preinfer.forward_backward import forward_backward, to_device
from preinfer.grad_buckets import BucketedAllReduce
from preinfer.layer_major import layer_major
from preinfer.moe import RouterLoss
from preinfer.parallel_dims import ParallelDims
from preinfer.partition import Block
from preinfer.replica_sync import OuterStep
from preinfer.run_dir import RunDir
from preinfer.staged import StagedModel
from preinfer.visit_optimizer import VisitOptimizer, clip_norm
from preinfer.wire import Wire


class Seams(Protocol):
    """Where the model lives, as the trainer asks (see the module's table)."""

    rank: int
    world_size: int
    wire: Wire | None  # counts the bytes sent to the data-parallel replicas (None: there are none)

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

    def end_step(self) -> None:
        """After each step: gradients beyond the optimizer's own dropped, replicas averaged when due."""
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
    step_replicas = 1  # the replicas whose batches one step's gradient is the mean over
    wire: Wire | None = None
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
        share = self.config.optim.grad_accum * self.step_replicas
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

    def end_step(self) -> None:
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
    """The whole model in every process of torchrun's group, each a replica reading its share of every batch.
    `--dp-sync step`: the active block's gradients are summed in buckets launched as backward completes them
    (`BucketedAllReduce`; compressed with `--grad-compression`), and the fused step steps each tensor once its
    bucket's sum is back. `visit`, `every:N`: each replica steps on its own share, and the replicas average the
    block at the visit's end or every N steps (`preinfer.replica_sync`). Each replica checkpoints its own state.
    Every collective goes through the replicas' `wire`, which counts the bytes sent."""

    def __init__(self, staged: StagedModel, config: Config, dims: ParallelDims):
        super().__init__(staged, config)
        self.rank, self.world_size = dims.rank, dims.data
        self.wire = Wire(dims.data_group)
        self.sync = parse_dp_sync(config.run.dp_sync)
        self.step_replicas = self.world_size if self.sync.per_step else 1
        self.reducer: BucketedAllReduce | None = None
        self.outer: OuterStep | None = None
        self.saved_sync: list[torch.Tensor] = []  # from a mid-visit checkpoint, for the visit it resumes

    def activate(self, block: Block, boundary: int, visit: VisitOptimizer) -> None:
        """The visit's buckets (the fused step, watching the block until now, steps each tensor once it is summed),
        or the outer step of visit and every:N sync."""
        r = self.config.run
        if self.sync.per_step:
            self.reducer = BucketedAllReduce(visit.active.masters, wire=self.wire, compression=r.grad_compression,
                                             state=self.saved_sync)
            self.reducer.on_reduced = visit.active.watch(self.reducer.grad_ready)
        else:
            self.outer = OuterStep(visit.active.masters, self.wire, r.outer_lr, r.outer_momentum,
                                   visit.active.cast_down, self.saved_sync)
        self.saved_sync = []

    def sum_over_replicas(self, tensor: torch.Tensor) -> None:
        """Summed under step sync; each replica's own otherwise."""
        if self.sync.per_step:
            self.wire.all_reduce(tensor)

    def reduce(self) -> None:
        """Wait for the buckets, write the sums into the gradients, and expect the next step's."""
        if self.reducer is not None:
            self.reducer.finish()
            self.reducer.start_step()

    def combine(self, total: float, tokens: int) -> tuple[float, int]:
        """The step's loss: the sum of the replicas' shares (step sync), or the mean of their own losses."""
        summed = torch.tensor(total, device=self.device)
        self.wire.all_reduce(summed)
        return summed.item() / (1 if self.sync.per_step else self.world_size), tokens

    def end_step(self) -> None:
        """every:N: the replicas average the block after every N steps of the visit."""
        if self.outer is not None:
            self.outer.stepped()
            if self.outer.steps == self.sync.every:
                self.outer.sync()

    def deactivate(self) -> None:
        """The replicas average the block, unless they did after the visit's last step."""
        if self.outer is not None and self.outer.steps:
            self.outer.sync()
        self.reducer, self.outer = None, None

    def stop_agreed(self, requested: bool) -> bool:
        return any_rank(requested, self.device, self.wire)

    def checkpoint_dir(self, run_dir: RunDir) -> Path:
        """Replica 0's is `checkpoint/`, every other one's its own (its data cursor, random state and, where the
        replicas train apart, its weights and optimizer state are its own)."""
        return run_dir.checkpoint if self.rank == 0 else run_dir.replica_checkpoint(self.rank)

    def save(self, run_dir: RunDir, model: nn.Module, optimizers: dict[int, dict], trainer_state: dict,
             masters: list[torch.Tensor]) -> None:
        """Every replica's own checkpoint, with the sync's state mid-visit (the outer step's, or PowerSGD's)."""
        sync = self.outer.state() if self.outer is not None else self.reducer.state() if self.reducer else []
        save_checkpoint(self.checkpoint_dir(run_dir), model, optimizers, trainer_state, masters, sync)

    def load(self, run_dir: RunDir, model: nn.Module) -> Checkpoint:
        """This replica's own checkpoint (every replica's must be of one step: a rank killed in a save may leave its
        previous one)."""
        checkpoint = load_checkpoint(self.checkpoint_dir(run_dir), model)
        require_one_step(checkpoint, run_dir, "replicas'")
        self.saved_sync = checkpoint.sync
        return checkpoint


def require_one_step(checkpoint: Checkpoint, run_dir: RunDir, whose: str) -> None:
    """Refuse checkpoints of different steps across the default group's ranks (each rank passes its own)."""
    step = torch.tensor(checkpoint.trainer["global_step"], dtype=torch.int64)
    lowest, highest = step.clone(), step.clone()
    dist.all_reduce(lowest, op=dist.ReduceOp.MIN)
    dist.all_reduce(highest, op=dist.ReduceOp.MAX)
    if lowest != highest:
        raise PreinferError(f"the {whose} checkpoints in {run_dir.path} are of different steps ({int(lowest)} to "
                            f"{int(highest)}); the run cannot resume from them")


def any_rank(flag: bool, device: torch.device, wire: Wire | None = None) -> bool:
    """Whether `flag` is set on any rank of the wire's group (None: of the default group, not counted)."""
    summed = torch.tensor(float(flag), device=device)
    if wire is None:
        dist.all_reduce(summed, op=dist.ReduceOp.MAX)
    else:
        wire.all_reduce(summed, op=dist.ReduceOp.MAX)
    return bool(summed.item())


def replica_seams(staged: StagedModel, config: Config, dims: ParallelDims) -> SingleProcess:
    """One process, or a data-parallel replica of `dims`."""
    return DataParallel(staged, config, dims) if dims.data > 1 else SingleProcess(staged, config)
