"""A run on a pipeline of N stages x D data-parallel replicas under torchrun, as the one run path
(`pipelines.training.runner.run`) asks of a placement: the flags a pipeline cannot take and the stages (cut from the
model's shape alone) and the precision (resolved once, from the weight files' dtype) are checked before anything
is loaded or written (the world size with the run's `ParallelDims`); each rank loads only its stage's weights
and trains it with the one `preinfer.trainer.Trainer` on its stage's seams
(`pipelines.pipeline_parallel.stage.StageSeams`), and the export is gathered from the stages' checkpoint."""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import torch
from torch import nn

import preinfer
from preinfer.batch_source import LiveSources, VisitSources
from preinfer.memory.budget import PRECISION_DTYPES
from preinfer.config import Config
from preinfer.errors import UsageError
from preinfer.memory.layer_spans import LayerSpan, block_spans
from preinfer.memory.settings import Settings
from preinfer.memory.shapes import shape_from_config
from preinfer.parallel_dims import ParallelDims
from preinfer.precision import Precision, resolve_precision, weights_dtype
from preinfer.run_dir import RunDir
from preinfer.seams import Seams
from preinfer.memory.stage_cut import cut_stages, describe_stages, stage_cost
from pipelines.models.export import export_from_weights
from pipelines.models.suffix import Suffix, load_modules, meta_model, prefix_digest, to_device
from pipelines.pipeline_parallel.stage import StageSeams
from pipelines.pipeline_parallel.visit import StageLink
from pipelines.models.partition_choice import partition_for
from pipelines.pre_inference import PreInference
from pipelines.pre_inference.stage_writer import stage_pre_inference
from pipelines.data.run_data import Datasets


class PipelinePlacement:
    """One stage of the pipeline per rank of `dims`, the stages those of `plan`. The fused step with replicas is
    refused (their gradients are summed after backward)."""

    def __init__(self, config: Config, dims: ParallelDims, plan: StagePlan):
        if config.optim.fused_step and dims.data > 1:
            raise UsageError(f"--fused-step steps each tensor as backward completes its gradient, before the "
                             f"{dims.data} replicas sum the gradients: drop --fused-step, or run one replica of the "
                             f"pipeline (torchrun --nproc-per-node {config.run.pipeline})")
        self.config, self.dims = config, dims
        self.stages, self.peaks, self.resolved, self.microbatches, self.first = plan
        self.stores: PreInference | None = None

    def load(self, first: int) -> nn.Module:
        """This rank's stage (every other weight stays on the meta device)."""
        r = self.config.run
        stage = self.stages[self.dims.stage]
        model = load_modules(self.config.model.name, lambda s: s.stage_modules(stage.start, stage.stop, stage.embed,
                                                                               stage.head),
                             f"stage {self.dims.stage}", r.seed, self.config.model.attention)
        return to_device(model, r.device)

    def notes(self) -> list[str]:
        """The stages with their predicted peaks, and what pre-inference auto does on a pipeline."""
        r = self.config.run
        notes = [describe_stages(self.stages, self.peaks, self.dims.data, self.microbatches, r.pipeline_schedule)]
        if self.first == 0 and self.config.pre_inference.mode == "auto":
            notes.append("pre-inference auto: a pipeline run trains live (its sweep planner is not built for "
                         "pipelines; --pre-inference on reads a store for every visit above the input)")
        return notes

    def prefix(self, boundary: int) -> Suffix:
        """The digest of the model's weights below `boundary`, streamed from its files (no stage holds them)."""
        return prefix_digest(self.config.model.name, boundary, self.config.run.seed)

    def pre_inference(self, staged: preinfer.StagedModel, data: Datasets, live: LiveSources,
                      shard: int, quiet: bool) -> VisitSources:
        """Live sources, or with `--pre-inference on` stores the stages make for every visit above the input."""
        if self.config.pre_inference.mode != "on":
            return live
        link = StageLink(staged, self.stages, self.dims, torch.device(self.config.run.device))
        self.stores = stage_pre_inference(staged, link, data, self.config, live, shard, quiet)
        return self.stores

    def precision(self, model: nn.Module) -> Precision:
        """The run's precision, resolved with the stages from the weight files' dtype (the stage loads in it)."""
        return self.resolved

    def seams(self, staged: preinfer.StagedModel) -> Seams:
        """What the trainer asks of this rank's stage."""
        return StageSeams(staged, self.config, self.dims, self.stages, self.microbatches)

    def export(self, directory: Path) -> bool:
        """The model with the stages' gathered weights (`export_from_weights`)."""
        return export_from_weights(self.config.model.name, RunDir(self.config.run.out).checkpoint_weights,
                                   directory)

    def close(self) -> None:
        """Delete the stores the stages made (unless --keep-stores)."""
        if self.stores is not None:
            self.stores.close()


def microbatch_count(config: Config) -> int:
    """Micro-batches per step through the pipeline (`Config.validate` has checked that they divide the batch and
    fill the schedule)."""
    return config.run.microbatches or config.run.pipeline


class StagePlan(NamedTuple):
    """A pipeline run's stages over layers [first, L) (above a store's boundary `first`), each one's predicted
    peak, the run's precision and the micro-batches of a step."""

    stages: list[LayerSpan]
    peaks: list[int]
    precision: Precision
    microbatches: int
    first: int


def run_stages(config: Config, first: int = 0) -> StagePlan:
    """The stages of the run over layers `[first, L)`, from the model's shape and its weight files' dtype alone
    (no weights are read, no process group is asked)."""
    microbatches = microbatch_count(config)
    model = meta_model(config.model.name, config.model.attention)
    staged = preinfer.stage(model)
    if staged.expert_shares():
        raise UsageError(f"--pipeline: {config.model.name} is a mixture-of-experts model; its router loss spans "
                         f"stages, which is not built yet")
    precision = resolve_precision(config.run.precision, weights_dtype(model))
    partition, _ = partition_for(staged, config, first_layer=first, precision=precision)
    blocks = block_spans(partition)
    shape = shape_from_config(model.config)
    r = config.run
    settings = Settings(seq_len=config.data.seq_len, micro_batch=config.data.batch_size // microbatches,
                        dtype=PRECISION_DTYPES[precision], recompute=r.recompute,
                        attention=config.model.attention, frozen_dtype=config.model.frozen_dtype,
                        optimizer=config.optim.name, fused_step=config.optim.fused_step)
    stages = cut_stages(shape, settings, r.pipeline, blocks, microbatches, r.pipeline_schedule, first)
    peaks = [stage_cost(shape, settings, stage, j, r.pipeline, blocks, microbatches, r.pipeline_schedule)
             for j, stage in enumerate(stages)]
    return StagePlan(stages, peaks, precision, microbatches, first)
