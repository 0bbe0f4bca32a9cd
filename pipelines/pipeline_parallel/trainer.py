"""The BCD trainer on a pipeline: the same sweeps, visits, stopping rules, steps, memory sampling, refusals and
records as `preinfer.trainer`, with each rank holding one stage. It replaces only what a stage does otherwise:
the forward and backward of a step (over the stages), how the loss, tokens and gradient norm combine across
stages, the tied weight's sharing, evaluation's sums, checkpoints and resuming.

Per step: every rank of a replica reads the same batch; the visit's pipeline (`pipelines.pipeline_parallel.visit`) runs
it; a tied weight held by both end stages (GPT-2's `wte` = `lm_head`) behaves as one tensor: when its block
trains, the last stage sends each micro-batch's gradient of it to the first (the owner, whose optimizer alone
steps it), which adds it to its own as the micro-batch's backward reaches the embedding, and the last stage
gets the updated values back after the step. Only stages holding part of the active block keep optimizer state (the
others step an optimizer over no tensors); the active block's gradients are summed across replicas per stage.
The loss, gradient norm and eval loss are combined across stages so that every rank takes the same decisions.
Checkpoints are written per stage (`checkpoint/stage-J/`, by the first replica), and rank 0 gathers the stages'
weights into `checkpoint/model.safetensors`, which the export and `--model RUN_DIR` read.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

from preinfer.checkpoint import WEIGHTS, load_checkpoint, save_checkpoint
from preinfer.errors import PreinferError
from preinfer.grad_buckets import BucketedAllReduce
from preinfer.memory.layer_spans import LayerSpan
from preinfer.metrics import Record, VisitRecord
from preinfer.partition import Block
from preinfer.precision import ActiveBlock
from preinfer.batch_source import BatchSource
from preinfer.trainer import Trainer
from pipelines.pipeline_parallel.mesh import PipelineMesh
from pipelines.pipeline_parallel.visit import VisitPipeline, evaluate_stage


TIED_TAG = 7  # point-to-point messages of tied-weight gradients (apart from the hidden states')


class PipelineTrainer(Trainer):
    def __init__(self, *args, mesh: PipelineMesh, stages: list[LayerSpan], microbatches: int, schedule: str,
                 **kwargs):
        super().__init__(*args, **kwargs)
        self.mesh, self.stages, self.microbatches, self.schedule = mesh, stages, microbatches, schedule
        self.stage = stages[mesh.stage]
        # Tensors both end stages hold (a tied embedding and head): the first stage owns them.
        embed = {id(p) for m in self.staged.embed_modules() for p in m.parameters() if not p.is_meta}
        self.tied = [p for m in self.staged.head_modules() for p in m.parameters() if id(p) in embed] \
            if mesh.stages > 1 and (mesh.is_first or mesh.is_last) else []
        self.borrowed = {id(p) for p in self.tied} if not mesh.is_first else set()
        self.pipeline: VisitPipeline | None = None
        self.tied_hooks: list = []  # while the tied weight's block trains: the hooks joining its two gradients
        self.tied_sends: list[dist.Work] = []  # the last stage's sends of this step's head parts

    def _activate(self, block: Block, train: BatchSource | None = None) -> tuple[torch.optim.Optimizer, ActiveBlock]:
        """As `Trainer._activate`, for the part of `block` this stage holds (none: an optimizer over nothing);
        then the visit's pipeline and, when `block` holds the tied weight, the hooks joining its gradients."""
        optimizer, active = super()._activate(block, train)
        source = train.boundary if train is not None else 0
        self.pipeline = VisitPipeline(self.staged, self.stages, self.mesh, block, self.microbatches, self.schedule,
                                      self.config.run.recompute, self.device, source)
        self.tied_hooks = self._join_tied_grads() if self._owns_tied(block) else []
        return optimizer, active

    def _trained(self, block: Block) -> list[torch.nn.Parameter]:
        """The parameters of `block` this stage holds and owns."""
        return [p for p in block.params if not p.is_meta and id(p) not in self.borrowed]

    def _reducer(self, active: ActiveBlock) -> BucketedAllReduce | None:
        """Replicas: this stage's part of the active block, summed over its data group after the step's backward
        (a pipeline step's micro-batches end a gradient only when the whole step has run)."""
        if self.mesh.replicas == 1 or not active.masters:
            return None
        return BucketedAllReduce(active.masters, group=self.mesh.data_group)

    def _deactivate(self, block: Block) -> None:
        """As `Trainer._deactivate`; stages that idled below a store take the data cursor of the stage the store
        fed, so that the next visit reads on from the same place on every stage."""
        if self.pipeline.first > 0:
            cursor = [self.progress.cursor]
            dist.broadcast_object_list(cursor, src=self.mesh.rank_of(self.pipeline.first), group=self.mesh.pipe_group)
            self.progress.cursor = cursor[0]
        super()._deactivate(block)
        for hook in self.tied_hooks:
            hook.remove()
        self.pipeline, self.tied_hooks = None, []

    def forward_backward_step(self, batches: list[dict], block: Block, train: BatchSource, active: ActiveBlock,
                              count: torch.Tensor) -> tuple[float, int]:
        """Each batch through the visit's pipeline in micro-batches (the last stage holds the loss); the tied
        weight's gradients sent on the way have arrived when it returns."""
        summed = super().forward_backward_step(batches, block, train, active, count)
        for work in self.tied_sends:
            work.wait()
        self.tied_sends.clear()
        return summed

    def _forward_backward(self, batch: dict, block: Block, boundary: int, count: torch.Tensor) -> float:
        return self.pipeline.step(batch, count)

    def _fetch(self, train: BatchSource) -> list[dict]:
        """No batches for a stage wholly below the store this visit reads (it does no work)."""
        return [] if self.pipeline.idle else super()._fetch(train)

    def _sum_over_replicas(self, tensor: torch.Tensor) -> None:
        if self.mesh.data_group is not None and not self.pipeline.idle:
            dist.all_reduce(tensor, group=self.mesh.data_group)

    def _combine(self, total: float, tokens: int) -> tuple[float, int]:
        """The loss over every rank (only the last stage of each replica holds a share) and the replica's tokens,
        also on the stages that idled below a store."""
        loss = torch.tensor(total, device=self.device, dtype=torch.float64)
        dist.all_reduce(loss)
        if self.pipeline.first > 0:
            counted = torch.tensor(tokens, dtype=torch.int64, device=self.device)
            dist.all_reduce(counted, op=dist.ReduceOp.MAX, group=self.mesh.pipe_group)
            tokens = int(counted)
        return loss.item(), tokens

    def _after_update(self) -> None:
        if self.tied_hooks:
            self._share_tied_values()

    def _zero_grad(self, optimizer: torch.optim.Optimizer) -> None:
        """Also the borrowed tied weight's gradient on the last stage (no optimizer of its own steps it)."""
        super()._zero_grad(optimizer)
        for param in self.tied:
            param.grad = None

    def _owns_tied(self, block: Block) -> bool:
        """`block` holds the tied weight (every rank of the two end stages agrees)."""
        ids = {id(p) for p in block.params}
        return bool(self.tied) and all(id(p) in ids for p in self.tied)

    def _join_tied_grads(self) -> list:
        """Hooks that make each micro-batch's gradient of a tied weight, on the owner, its embedding's part plus
        the head's part (sent by the last stage as its backward makes it), as autograd sums the two uses of one
        tensor in one process: the same sums in the same order. Returns the hooks' handles."""
        def send(grad: torch.Tensor) -> None:
            self.tied_sends.append(dist.isend(grad.contiguous(), self.mesh.rank_of(0), tag=TIED_TAG))

        def add_head_part(grad: torch.Tensor) -> torch.Tensor:
            head = torch.empty_like(grad)
            dist.recv(head, self.mesh.rank_of(self.mesh.stages - 1), tag=TIED_TAG)
            return head + grad

        return [param.register_hook(add_head_part if self.mesh.is_first else send) for param in self.tied]

    @torch.no_grad()
    def _share_tied_values(self) -> None:
        """The owner's stepped values of each tied weight, copied into the last stage's."""
        for param in self.tied:
            if self.mesh.is_first:
                dist.send(param.detach().contiguous(), self.mesh.rank_of(self.mesh.stages - 1))
            else:
                value = torch.empty_like(param)
                dist.recv(value, self.mesh.rank_of(0))
                param.copy_(value)

    def _clip(self, active: ActiveBlock, max_norm: float) -> None:
        """Clip the active block's gradient norm over every stage (as `clip_grad_norm_` would over one)."""
        grads = [m.grad for m in active.masters if m.grad is not None]
        square = torch.zeros((), dtype=torch.float32, device=self.device)
        for grad in grads:
            square += grad.float().pow(2).sum()
        dist.all_reduce(square, group=self.mesh.pipe_group)
        coefficient = torch.clamp(max_norm / (square.sqrt() + 1e-6), max=1.0)
        for grad in grads:
            grad.mul_(coefficient.to(grad.dtype))

    def _eval_sums(self, source: BatchSource) -> tuple[float, int]:
        """The eval pass forward through every stage, its sums combined so that every rank gets them."""
        total, count = evaluate_stage(self.staged, self.stages, self.mesh, source.one_pass(), self.device,
                                      source.boundary)
        both = torch.tensor([total, float(count)], dtype=torch.float64, device=self.device)
        dist.all_reduce(both, group=self.mesh.pipe_group)
        return both[0].item(), int(both[1].item())

    def emit(self, record: Record) -> None:
        """Records go out from rank 0; a visit record carries every rank's memory peaks (gathered here)."""
        if isinstance(record, VisitRecord) and self.meter is not None:
            record.ranks = self._rank_memory(record.memory)
        super().emit(record)

    def _rank_memory(self, memory: dict[str, int]) -> list[dict]:
        keys = list(memory)
        mine = torch.tensor([self.rank, self.mesh.stage, self.mesh.replica, *memory.values()], dtype=torch.int64)
        every = [torch.zeros_like(mine) for _ in range(self.world_size)]
        dist.all_gather(every, mine)
        return [{"rank": int(row[0]), "stage": int(row[1]), "replica": int(row[2]),
                 **{key: int(value) for key, value in zip(keys, row[3:])}} for row in every]

    @property
    def stage_dir(self) -> Path:
        return self.checkpoint_dir / f"stage-{self.mesh.stage}"

    def resume(self) -> None:
        """Continue from this stage's checkpoint (every stage's must be of the same step)."""
        checkpoint = load_checkpoint(self.stage_dir, self.staged.model)
        step = torch.tensor(checkpoint.trainer["global_step"], dtype=torch.int64)
        lowest, highest = step.clone(), step.clone()
        dist.all_reduce(lowest, op=dist.ReduceOp.MIN)
        dist.all_reduce(highest, op=dist.ReduceOp.MAX)
        if lowest != highest:
            raise PreinferError(f"the stage checkpoints in {self.checkpoint_dir} are of different steps "
                                f"({int(lowest)} to {int(highest)}); the run cannot resume from them")
        self.optimizer_states = checkpoint.optimizers
        self.progress = self.restored_progress(checkpoint.trainer, self.stage_dir)
        self.saved_masters = checkpoint.masters

    def _checkpoint(self, optimizers: dict[int, dict] | None = None, masters: list[torch.Tensor] = ()) -> None:
        """Each stage's checkpoint (first replica), then rank 0 gathers the stages' weights into one file."""
        if self.run_dir is None:
            return
        if self.mesh.replica == 0:
            states = self.optimizer_states if optimizers is None else optimizers
            save_checkpoint(self.stage_dir, self.staged.model, states, vars(self.progress), masters)
        dist.barrier()
        if self.rank == 0:
            gather_weights([self.checkpoint_dir / f"stage-{j}" / WEIGHTS for j in range(self.mesh.stages)],
                           self.run_dir.checkpoint_weights)
        dist.barrier()


def gather_weights(files: list[Path], out: Path) -> None:
    """One safetensors file of every tensor in `files` (a tied weight saved by two stages, once), replaced
    atomically."""
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        tensors.update(load_file(str(file)))
    tmp = out.with_name(out.name + ".tmp")
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    os.replace(tmp, out)
