"""The seams of one pipeline stage (`StageSeams`, a `preinfer.seams.Seams`): the one `preinfer.trainer.Trainer`
runs the same sweeps, visits, stopping rules, steps, memory sampling, refusals and records on a pipeline, with each
rank holding one stage. The stage does only what differs: the forward and backward of a step (over the stages),
how the loss, tokens and gradient norm combine across stages, the tied weight's sharing, evaluation's sums,
checkpoints and resuming.

Per step: every rank of a replica reads the same batch; the visit's pipeline (`pipelines.pipeline_parallel.visit`)
runs it; a tied weight held by both end stages (GPT-2's `wte` = `lm_head`) behaves as one tensor: when its block
trains, the last stage sends each micro-batch's gradient of it to the first (the owner, whose optimizer alone
steps it), which adds it to its own as the micro-batch's backward reaches the embedding, and the last stage
gets the updated values back after the step. Only stages holding part of the active block keep optimizer state (the
others step an optimizer over no tensors); the active block's gradients are summed across replicas per stage.
The loss, gradient norm and eval loss are combined across stages so that every rank takes the same decisions.
Checkpoints are written per stage and replica (`checkpoint/stage-J/` by the first replica, each other one's under
`replicas/`, with its own data cursor), and rank 0 gathers the first replica's stages' weights into
`checkpoint/model.safetensors`, which the export and `--model RUN_DIR` read.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file
from torch import nn

from preinfer.atomic_write import write_atomically
from preinfer.batch_source import BatchSource
from preinfer.checkpoint import WEIGHTS, Checkpoint, load_checkpoint, save_checkpoint
from preinfer.config import Config
from preinfer.forward_backward import to_device
from preinfer.grad_buckets import BucketedAllReduce
from preinfer.memory.layer_spans import LayerSpan
from preinfer.parallel_dims import ParallelDims
from preinfer.partition import Block
from preinfer.run_dir import RunDir
from preinfer.seams import any_rank, require_one_step
from preinfer.staged import StagedModel
from preinfer.visit_optimizer import VisitOptimizer
from preinfer.wire import Wire
from pipelines.pipeline_parallel.visit import VisitPipeline, evaluate_stage

TIED_TAG = 7  # point-to-point messages of tied-weight gradients (apart from the hidden states')


class StageSeams:
    """This rank's stage of the pipeline, as the trainer asks of its seams."""

    def __init__(self, staged: StagedModel, config: Config, dims: ParallelDims, stages: list[LayerSpan],
                 microbatches: int):
        self.staged, self.config, self.dims, self.stages, self.microbatches = staged, config, dims, stages, microbatches
        self.device = torch.device(config.run.device)
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        # Tensors both end stages hold (a tied embedding and head): the first stage owns them.
        embed = {id(p) for m in staged.embed_modules() for p in m.parameters() if not p.is_meta}
        self.tied = [p for m in staged.head_modules() for p in m.parameters() if id(p) in embed] \
            if dims.pipeline > 1 and (dims.is_first or dims.is_last) else []
        self.borrowed = {id(p) for p in self.tied} if not dims.is_first else set()
        self.pipeline: VisitPipeline | None = None
        self.reducer: BucketedAllReduce | None = None  # replicas: this stage's part of the active block
        self.wire = Wire(dims.data_group) if dims.data > 1 else None  # the sums over the stage's replicas
        self.tied_hooks: list = []  # while the tied weight's block trains: the hooks joining its two gradients
        self.tied_sends: list[dist.Work] = []  # the last stage's sends of this step's head parts

    def trained(self, block: Block) -> list[nn.Parameter]:
        """The parameters of `block` this stage holds and owns."""
        return [p for p in block.params if not p.is_meta and id(p) not in self.borrowed]

    def activate(self, block: Block, boundary: int, visit: VisitOptimizer) -> None:
        """The visit's pipeline; with replicas, this stage's buckets, summed over its data group after the step's
        backward (a pipeline step's micro-batches end a gradient only when the whole step has run); when `block`
        holds the tied weight, the hooks joining its gradients."""
        self.pipeline = VisitPipeline(self.staged, self.stages, self.dims, block, visit, self.microbatches,
                                      self.config.run.pipeline_schedule, self.config.run.recompute, self.device,
                                      boundary)
        if self.dims.data > 1 and visit.active.masters:
            self.reducer = BucketedAllReduce(visit.active.masters, wire=self.wire)
        self.tied_hooks = self._join_tied_grads() if self._owns_tied(block) else []
        if visit.scaler.enabled:
            visit.scaler.agree = self._any_rank_found_inf

    def _any_rank_found_inf(self, found: torch.Tensor) -> None:
        """fp16-mixed: `found` (whether this rank's gradients are not all finite) set on every rank where any
        stage or replica found one, so that all skip the same steps."""
        agreed = found.to(self.device)
        dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
        found.copy_(agreed)

    def fetch(self, train: BatchSource, count: int) -> list[dict]:
        """No batches for a stage wholly below the store this visit reads (it does no work)."""
        return [] if self.pipeline.idle else [to_device(next(train), self.device) for _ in range(count)]

    def sum_over_replicas(self, tensor: torch.Tensor) -> None:
        if self.wire is not None and not self.pipeline.idle:
            self.wire.all_reduce(tensor)

    def forward_backward(self, batches: list[dict], block: Block, boundary: int, count: torch.Tensor,
                         visit: VisitOptimizer) -> tuple[float, int]:
        """Each batch through the visit's pipeline in micro-batches (the last stage holds the loss); the tied
        weight's gradients sent on the way have arrived when it returns."""
        total, tokens = 0.0, 0
        for index, batch in enumerate(batches):
            total += self.pipeline.step(batch, count, last=index == len(batches) - 1)
            tokens += int(batch["attention_mask"].sum())
        for work in self.tied_sends:
            work.wait()
        self.tied_sends.clear()
        return total, tokens

    def reduce(self) -> None:
        if self.reducer is not None:
            self.reducer.finish()
            self.reducer.start_step()

    def combine(self, total: float, tokens: int) -> tuple[float, int]:
        """The loss over every rank (only the last stage of each replica holds a share) and the replica's tokens,
        also on the stages that idled below a store."""
        loss = torch.tensor(total, device=self.device, dtype=torch.float64)
        dist.all_reduce(loss)
        if self.pipeline.first > 0:
            counted = torch.tensor(tokens, dtype=torch.int64, device=self.device)
            dist.all_reduce(counted, op=dist.ReduceOp.MAX, group=self.dims.pipe_group)
            tokens = int(counted)
        return loss.item(), tokens

    def clip(self, tensors: list[torch.Tensor], max_norm: float) -> None:
        """Clip the active block's gradient norm over every stage (as `clip_grad_norm_` would over one)."""
        grads = [t.grad for t in tensors if t.grad is not None]
        square = torch.zeros((), dtype=torch.float32, device=self.device)
        for grad in grads:
            square += grad.float().pow(2).sum()
        dist.all_reduce(square, group=self.dims.pipe_group)
        coefficient = torch.clamp(max_norm / (square.sqrt() + 1e-6), max=1.0)
        for grad in grads:
            grad.mul_(coefficient.to(grad.dtype))

    def after_update(self) -> None:
        if self.tied_hooks:
            self._share_tied_values()

    def end_step(self) -> None:
        """The borrowed tied weight's gradient on the last stage (no optimizer of its own steps it)."""
        for param in self.tied:
            param.grad = None

    def shared_cursor(self, cursor: dict | None) -> dict | None:
        """Stages that idled below a store take the data cursor of the stage the store fed, so that the next visit
        reads on from the same place on every stage."""
        if self.pipeline.first == 0:
            return cursor
        shared = [cursor]
        dist.broadcast_object_list(shared, src=self.dims.rank_of(self.pipeline.first), group=self.dims.pipe_group)
        return shared[0]

    def deactivate(self) -> None:
        for hook in self.tied_hooks:
            hook.remove()
        self.pipeline, self.reducer, self.tied_hooks = None, None, []

    def eval_sums(self, source: BatchSource) -> tuple[float, int]:
        """The eval pass forward through every stage, its sums combined so that every rank gets them."""
        total, count = evaluate_stage(self.staged, self.stages, self.dims, source.one_pass(), self.device,
                                      source.boundary)
        both = torch.tensor([total, float(count)], dtype=torch.float64, device=self.device)
        dist.all_reduce(both, group=self.dims.pipe_group)
        return both[0].item(), int(both[1].item())

    def rank_memory(self, memory: dict[str, int]) -> list[dict]:
        """Every rank's peaks (a visit record's `ranks`), gathered from all."""
        keys = list(memory)
        mine = torch.tensor([self.rank, self.dims.stage, self.dims.replica, *memory.values()], dtype=torch.int64)
        every = [torch.zeros_like(mine) for _ in range(self.world_size)]
        dist.all_gather(every, mine)
        return [{"rank": int(row[0]), "stage": int(row[1]), "replica": int(row[2]),
                 **{key: int(value) for key, value in zip(keys, row[3:])}} for row in every]

    def stop_agreed(self, requested: bool) -> bool:
        return any_rank(requested, self.device)

    def checkpoint_dir(self, run_dir: RunDir) -> Path:
        """The first replica's stage J checkpoints in `checkpoint/stage-J/`, replica R's in
        `replicas/checkpoint-R/stage-J/` (its own data cursor, which reads its own share, and random state)."""
        replica = self.dims.replica
        mine = run_dir.checkpoint if replica == 0 else run_dir.replica_checkpoint(replica)
        return mine / f"stage-{self.dims.stage}"

    def save(self, run_dir: RunDir, model: nn.Module, optimizers: dict[int, dict], trainer_state: dict,
             masters: list[torch.Tensor]) -> None:
        """Each rank's stage checkpoint, then rank 0 gathers the first replica's stages' weights into one file."""
        save_checkpoint(self.checkpoint_dir(run_dir), model, optimizers, trainer_state, masters)
        dist.barrier()
        if self.rank == 0:
            gather_weights([run_dir.checkpoint / f"stage-{j}" / WEIGHTS for j in range(self.dims.pipeline)],
                           run_dir.checkpoint_weights)
        dist.barrier()

    def load(self, run_dir: RunDir, model: nn.Module) -> Checkpoint:
        """This stage's checkpoint (every stage's must be of the same step)."""
        checkpoint = load_checkpoint(self.checkpoint_dir(run_dir), model)
        require_one_step(checkpoint, run_dir, "stage")
        return checkpoint

    def _owns_tied(self, block: Block) -> bool:
        """`block` holds the tied weight (every rank of the two end stages agrees)."""
        ids = {id(p) for p in block.params}
        return bool(self.tied) and all(id(p) in ids for p in self.tied)

    def _join_tied_grads(self) -> list:
        """Hooks that make each micro-batch's gradient of a tied weight, on the owner, its embedding's part plus
        the head's part (sent by the last stage as its backward makes it), as autograd sums the two uses of one
        tensor in one process: the same sums in the same order. Returns the hooks' handles."""
        def send(grad: torch.Tensor) -> None:
            self.tied_sends.append(dist.isend(grad.contiguous(), self.dims.rank_of(0), tag=TIED_TAG))

        def add_head_part(grad: torch.Tensor) -> torch.Tensor:
            head = torch.empty_like(grad)
            dist.recv(head, self.dims.rank_of(self.dims.pipeline - 1), tag=TIED_TAG)
            return head + grad

        return [param.register_hook(add_head_part if self.dims.is_first else send) for param in self.tied]

    @torch.no_grad()
    def _share_tied_values(self) -> None:
        """The owner's stepped values of each tied weight, copied into the last stage's."""
        for param in self.tied:
            if self.dims.is_first:
                dist.send(param.detach().contiguous(), self.dims.rank_of(self.dims.pipeline - 1))
            else:
                value = torch.empty_like(param)
                dist.recv(value, self.dims.rank_of(0))
                param.copy_(value)


def gather_weights(files: list[Path], out: Path) -> None:
    """One safetensors file of every tensor in `files` (a tied weight saved by two stages, once), replaced
    atomically."""
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        tensors.update(load_file(str(file)))
    write_atomically(out, lambda file: save_file(tensors, str(file), metadata={"format": "pt"}))
