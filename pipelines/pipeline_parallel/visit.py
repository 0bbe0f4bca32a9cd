"""One visit's way through the pipeline.

The stage holding the active block's first layer (or the embedding, when the block holds it) is the visit's
entry stage s. Stages below s run forward only, under no_grad, one micro-batch after another, and send their
hidden states up: nothing is saved for backward and no gradient comes back. Stages s..N-1 train under a
`torch.distributed.pipelining` schedule (1F1B or GPipe) of their own, over a process group of just those
ranks, in which stage s is the first: its input is a root argument that needs no gradient.

Why the frozen stages stay out of the schedule: the engine runs backward on every stage of a schedule and
calls `torch.autograd.backward` on each stage's output, which fails when nothing below the output requires
grad ("element 0 of tensors does not require grad"), the crash DeepSpeed's users report for frozen stages;
`PipelineStage` has no forward-only stage inside a training schedule. Stages above the active block are
ordinary stages of the schedule whose parameters do not require grad: backward gives them input gradients only.

Shapes are given to `PipelineStage` statically (its dynamic shape inference runs a real forward and backward
on the first step), one schedule per batch shape: a short last batch of an epoch gets the largest micro-batch
count not above M that divides it (GPipe when 1F1B would need more micro-batches than stages).

The visit's optimizer (`VisitOptimizer`) reaches into the schedule at two points: the last stage's loss is
scaled by it (fp16-mixed's loss scale, where the loss is), and before each micro-batch's backward the stage tells
its active block whether that backward is the step's last (the last micro-batch of the step's last batch), so that
the fused step steps each tensor once its gradient is complete.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

from preinfer.memory.layer_spans import LayerSpan
from preinfer.parallel_dims import ParallelDims
from preinfer.partition import Block
from preinfer.staged import StagedModel, supervised_tokens
from preinfer.visit_optimizer import VisitOptimizer
from pipelines.pipeline_parallel.stage_module import StageModule

SCHEDULES = {"1f1b": Schedule1F1B, "gpipe": ScheduleGPipe}


def stage_of(stages: list[LayerSpan], layer: int) -> int:
    """The stage holding `layer` (the last for the head's boundary, the first below the stages' first layer)."""
    return next((j for j, s in enumerate(stages) if layer < s.stop), len(stages) - 1)


def entry_stage(stages: list[LayerSpan], block: Block) -> int:
    """The first stage that trains for `block`: the one holding its first layer (the first stage when it holds
    the embedding, the last when it holds only the head)."""
    return 0 if block.has_embed else stage_of(stages, block.start)


class VisitStage(PipelineStage):
    """A `PipelineStage` that calls `before_backward(i)` before the backward of micro-batch i."""

    def __init__(self, *args, before_backward: Callable[[int], None], **kwargs):
        super().__init__(*args, **kwargs)
        self.before_backward = before_backward

    def backward_one_chunk(self, bwd_chunk_id: int, *args, **kwargs):
        self.before_backward(bwd_chunk_id)
        return super().backward_one_chunk(bwd_chunk_id, *args, **kwargs)


class VisitPipeline:
    """Runs the batches of one visit through this rank's stage (see the module docstring), for `visit`'s
    optimizer."""

    def __init__(self, staged: StagedModel, stages: list[LayerSpan], dims: ParallelDims, block: Block,
                 visit: VisitOptimizer, microbatches: int, schedule: str, recompute: bool, device: torch.device,
                 source: int = 0):
        self.staged, self.stages, self.dims, self.device, self.visit = staged, stages, dims, device, visit
        self.microbatches, self.schedule_name = microbatches, schedule
        self.entry = entry_stage(stages, block)
        self.first = stage_of(stages, source)  # the stage the batches feed (a store at `source` > 0, else tokens)
        self.idle = dims.stage < self.first  # wholly below the store: runs nothing this visit
        self.frozen = dims.stage < self.entry
        stage = stages[dims.stage]
        self.module = StageModule(staged, stage, None if self.frozen else block, recompute, source)
        self.schedules: dict[tuple[int, ...], object] = {}
        self.count = torch.ones((), device=device)  # supervised tokens of the global batch (the loss divisor)
        self.parts, self.last_batch = 1, True  # the batch in the schedule: its micro-batches, whether the step's last

    def step(self, batch: dict[str, torch.Tensor], count: torch.Tensor, last: bool = True) -> float:
        """Forward and backward of one batch (all its micro-batches; `last`: the step's last batch); the
        gradients accumulate into the parameters that require grad. Returns this stage's share of the loss (the
        last stage's sum over micro-batches of supervised-token loss / `count`; 0 elsewhere)."""
        self.count, self.last_batch = count, last
        root, mask = stage_input(batch, self.staged), batch["attention_mask"]
        parts = self.parts = self._parts(mask.shape[0])
        if self.frozen:
            self._forward_only(root, mask, parts)
            return 0.0
        schedule = self._schedule(mask.shape, parts)
        kwargs = dict(attention_mask=mask)
        if self.dims.stage == self.entry:
            x = root if self.dims.stage == self.first else self._receive_all(mask.shape, mask, parts)
            args = (x,)
        else:
            args = ()
        losses: list[torch.Tensor] = []
        if self.dims.is_last:
            schedule.step(*args, target=batch["labels"], losses=losses, **kwargs)
        else:
            schedule.step(*args, **kwargs)
        return float(sum(loss.item() for loss in losses)) / self.visit.scaler.scale

    def _loss(self, output: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The micro-batch's loss of the last stage's `head_output`, scaled (fp16-mixed) for its backward."""
        return self.visit.scale_loss(self.staged.output_loss_sum(output, labels) / self.count)

    def _before_backward(self, part: int) -> None:
        self.visit.active.last_micro_batch = self.last_batch and part == self.parts - 1

    def _parts(self, rows: int) -> int:
        """Micro-batches for a batch of `rows` samples: M, or for a short batch the most that divide it."""
        return next(m for m in range(min(self.microbatches, rows), 0, -1) if rows % m == 0)

    @torch.no_grad()
    def _forward_only(self, root: torch.Tensor, mask: torch.Tensor, parts: int) -> None:
        """A stage below the active block: each micro-batch in, through its layers without autograd, out."""
        for root_part, mask_part in zip(root.chunk(parts), mask.chunk(parts)):
            x = root_part if self.dims.stage == self.first else self._receive(mask_part.shape)
            dist.send(self.module(x, mask_part).contiguous(), self.dims.rank_of(self.dims.stage + 1))

    def _receive(self, shape: torch.Size) -> torch.Tensor:
        return receive_hidden(self.staged, self.dims, shape, self.device)

    def _receive_all(self, shape: torch.Size, mask: torch.Tensor, parts: int) -> torch.Tensor:
        """The entry stage above the first: every micro-batch's hidden states from the frozen stage below."""
        return torch.cat([self._receive(piece.shape) for piece in mask.chunk(parts)])

    def _schedule(self, shape: torch.Size, parts: int):
        """The schedule (and its `PipelineStage`) for batches of `shape` split into `parts` micro-batches."""
        key = (*shape, parts)
        if key not in self.schedules:
            index, count = self.dims.stage - self.entry, self.dims.pipeline - self.entry
            rows, length = shape[0] // parts, shape[1]
            if index == 0 and self.module.embeds:
                example_in = torch.empty(rows, length, dtype=torch.long, device="meta")
            else:
                example_in = torch.empty(rows, length, self.staged.hidden_size, dtype=self.staged.compute_dtype,
                                         device="meta", requires_grad=index > 0)
            stage = self.stages[self.dims.stage]
            logits = stage.head and self.staged.loss_kind == "plain"
            width = self.staged.model.config.vocab_size if logits else self.staged.hidden_size
            example_out = torch.empty(rows, length, width, dtype=self.staged.compute_dtype, device="meta",
                                      requires_grad=True)
            pipeline_stage = VisitStage(self.module, index, count, self.device, input_args=example_in,
                                        output_args=example_out, group=self.dims.tails[self.entry],
                                        before_backward=self._before_backward)
            kind = SCHEDULES[self.schedule_name]
            if kind is Schedule1F1B and parts < count:
                kind = ScheduleGPipe
            self.schedules[key] = kind(pipeline_stage, parts, loss_fn=self._loss, scale_grads=False)
        return self.schedules[key]



def stage_input(batch: dict[str, torch.Tensor], staged: StagedModel) -> torch.Tensor:
    """What the first stage takes: token ids, or (training from a store) the stored hidden states in the compute
    dtype."""
    return batch["input_ids"] if "input_ids" in batch else batch["hidden"].to(staged.compute_dtype)


def receive_hidden(staged: StagedModel, dims: ParallelDims, shape: torch.Size, device: torch.device) -> torch.Tensor:
    """The hidden states of a batch of `shape` (rows, tokens) from the stage below."""
    hidden = torch.empty(*shape, staged.hidden_size, dtype=staged.compute_dtype, device=device)
    dist.recv(hidden, dims.rank_of(dims.stage - 1))
    return hidden


class StageLink:
    """This rank's stage as pre-inference's stage writer reaches the others
    (`pipelines.pre_inference.stage_writer.StageLink`)."""

    def __init__(self, staged: StagedModel, spans: list[LayerSpan], dims: ParallelDims, device: torch.device):
        self.staged, self.spans, self.dims, self.device = staged, spans, dims, device
        self.stage, self.replica, self.replicas = dims.stage, dims.replica, dims.data
        self.module = StageModule(staged, spans[dims.stage])

    def holding(self, layer: int) -> int:
        return stage_of(self.spans, layer)

    def gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        every = [torch.zeros_like(tensor) for _ in range(self.dims.pipeline)]
        dist.all_gather(every, tensor, group=self.dims.pipe_group)
        return every

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return self.module(x, attention_mask)

    def receive(self, shape: torch.Size) -> torch.Tensor:
        return receive_hidden(self.staged, self.dims, shape, self.device)

    def send(self, hidden: torch.Tensor) -> None:
        dist.send(hidden.contiguous(), self.dims.rank_of(self.dims.stage + 1))


@torch.no_grad()
def evaluate_stage(staged: StagedModel, stages: list[LayerSpan], dims: ParallelDims, batches: Iterable[dict],
                   device: torch.device, source: int = 0) -> tuple[float, int]:
    """Whole eval batches (at boundary `source`) forward through the stages of this rank's replica from the one
    holding `source`: (loss sum, supervised tokens) on the last stage, (0, 0) elsewhere."""
    first = stage_of(stages, source)
    if dims.stage < first:
        return 0.0, 0
    module = StageModule(staged, stages[dims.stage], source=source)
    total, count = 0.0, 0
    for batch in batches:
        batch = {k: v.to(device) for k, v in batch.items()}
        mask = batch["attention_mask"]
        x = stage_input(batch, staged) if dims.stage == first else receive_hidden(staged, dims, mask.shape, device)
        out = module(x, mask)
        if not dims.is_last:
            dist.send(out.contiguous(), dims.rank_of(dims.stage + 1))
            continue
        labels = batch["labels"].to(device)
        total += staged.output_loss_sum(out, labels).item()
        count += supervised_tokens(labels)
    return total, count
