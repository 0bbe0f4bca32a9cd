"""`preinfer bcd --pipeline N`: the whole run on a pipeline of N stages x D data-parallel replicas under
torchrun. Every input is checked (flags, stages against layers, world size) before anything is loaded or
written; then each rank loads only its stage's weights, trains, and rank 0 writes the export."""

from __future__ import annotations

from functools import partial
from pathlib import Path

import preinfer
from preinfer.budget import PRECISION_DTYPES
from preinfer.config import Config
from preinfer.errors import UsageError
from preinfer.memory_model import Block, Settings, shape_from_config
from preinfer.precision import resolve_precision, weights_dtype
from preinfer.run_dir import RunDir
from preinfer.stages import describe_stages, plan_stages, stage_cost
from pipelines.pipeline.mesh import check_degree, make_mesh
from pipelines.pipeline.trainer import PipelineTrainer
from pipelines.suffix import export_from_weights, load_modules, meta_model, to_device
from pipelines.training import (
    check_run_dir, finish_run, init_distributed, live_sources, load_datasets, partition_for, samples_per_shard,
    set_precision, train,
)


def check_flags(config: Config) -> int:
    """The micro-batch count; a UsageError for a flag a pipeline run cannot take."""
    r, batch = config.run, config.data.batch_size
    microbatches = r.microbatches or r.pipeline
    if batch % microbatches:
        raise UsageError(f"--microbatches {microbatches} does not divide --batch-size {batch}")
    if r.schedule == "1f1b" and microbatches < r.pipeline:
        raise UsageError(f"--schedule 1f1b needs at least as many --microbatches as --pipeline stages "
                         f"({microbatches} < {r.pipeline}); give more or --schedule gpipe")
    if config.pre_inference.mode == "on":
        raise UsageError("--pre-inference on does not run on a pipeline yet (stores are built by one process "
                         "holding the prefix); give --pre-inference off, or drop --pipeline")
    if r.precision == "fp16-mixed":
        raise UsageError("--precision fp16-mixed (loss scaling) does not run on a pipeline; give bf16-mixed or fp32")
    if config.blocks.experts:
        raise UsageError("--experts (expert-granular blocks) runs in one process; drop it or --pipeline")
    return microbatches


def plan(config: Config, microbatches: int) -> tuple[list[Block], list[int], str]:
    """The stages of the run, each one's predicted peak, and the resolved precision (from the model's shape
    alone: no weights are read)."""
    model = meta_model(config.model.name)
    staged = preinfer.stage(model)
    if staged.expert_shares():
        raise UsageError(f"--pipeline: {config.model.name} is a mixture-of-experts model; its router loss spans "
                         f"stages, which is not built yet")
    precision = resolve_precision(config.run.precision, weights_dtype(model))
    partition, _ = partition_for(staged, config, precision=precision)
    blocks = [Block(b.start, b.stop, b.has_embed, b.has_head) for b in partition.blocks]
    shape = shape_from_config(model.config)
    r = config.run
    settings = Settings(seq_len=config.data.seq_len, micro_batch=config.data.batch_size // microbatches,
                        dtype=PRECISION_DTYPES[precision], recompute=r.recompute)
    stages = plan_stages(shape, settings, r.pipeline, blocks, microbatches, r.schedule)
    peaks = [stage_cost(shape, settings, stage, j, r.pipeline, blocks, microbatches, r.schedule)
             for j, stage in enumerate(stages)]
    return stages, peaks, precision


def run_pipeline_bcd(config: Config, resume: bool = False, quiet: bool = False) -> dict:
    """Train a whole model on a pipeline (prefix live) and write the run directory; returns the summary."""
    r = config.run
    microbatches = check_flags(config)
    stages, peaks, precision = plan(config, microbatches)
    rank, world = init_distributed(r.device)
    replicas = check_degree(r.pipeline, world)
    run = RunDir(r.out)
    if rank == 0:
        check_run_dir(run, resume)
    mesh = make_mesh(r.pipeline, r.device)
    stage = stages[mesh.stage]
    model = load_modules(config.model.name, lambda s: s.stage_modules(stage.start, stage.stop, stage.embed,
                                                                        stage.head),
                         f"stage {mesh.stage}", seed=r.seed)
    staged = preinfer.stage(to_device(model, r.device))
    notes = [set_precision(model, config), describe_stages(stages, peaks, replicas, microbatches, r.schedule)]
    if config.pre_inference.mode == "auto":
        notes.append("pre-inference auto: a pipeline run trains live (stores are not built on a pipeline yet)")
    data = load_datasets(config, quiet)
    partition, active = partition_for(staged, config, precision=precision)
    chosen = live_sources(data, config, samples_per_shard(config, staged), mesh.replica, mesh.replicas)
    make = partial(PipelineTrainer, mesh=mesh, stages=stages, microbatches=microbatches, schedule=r.schedule)
    trainer = train(config, staged, partition, active, chosen, resume, quiet, notes, command="bcd", make=make)

    def export(directory: Path) -> None:
        export_from_weights(config.model.name, run.checkpoint_weights, directory)
        data.tokenizer.save(directory)

    return finish_run(trainer, run, export)
