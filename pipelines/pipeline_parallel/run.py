"""`preinfer bcd --pipeline N` and `preinfer train --store CACHE --pipeline N`: the run on a pipeline of N stages
x D data-parallel replicas under torchrun. Every input is checked (flags, stages against layers, world size) before anything is loaded or
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
from preinfer.batch_source import LiveSources
from pipelines.data.tokenizer_choice import model_tokenizer
from preinfer.stage_cut import describe_stages, plan_stages, stage_cost
from pipelines.cache import open_cache
from pipelines.pipeline_parallel.mesh import PipelineMesh, check_degree, make_mesh
from pipelines.pipeline_parallel.stores import PipelineStores
from pipelines.pipeline_parallel.trainer import PipelineTrainer
from pipelines.data.batches import ReaderBatches
from pipelines.models.suffix import export_from_weights, load_modules, meta_model, prefix_digest, to_device
from pipelines.data.token_store.resolve import eval_samples
from pipelines.training import (
    check_prefix, check_run_dir, finish_run, init_distributed, live_sources, load_datasets, partition_for,
    samples_per_shard, save_store_tokenizer, set_precision, train,
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
    if config.pre_inference.mode == "on" and config.pre_inference.dask:
        raise UsageError("--dask builds stores in other processes; on a pipeline the stages build them: drop --dask")
    if r.precision == "fp16-mixed":
        raise UsageError("--precision fp16-mixed (loss scaling) does not run on a pipeline; give bf16-mixed or fp32")
    if config.blocks.experts:
        raise UsageError("--experts (expert-granular blocks) runs in one process; drop it or --pipeline")
    return microbatches


def plan(config: Config, microbatches: int, first: int = 0) -> tuple[list[Block], list[int], str]:
    """The stages of the run over layers `[first, L)` (above a store's boundary), each one's predicted peak, and
    the resolved precision (from the model's shape alone: no weights are read)."""
    model = meta_model(config.model.name)
    staged = preinfer.stage(model)
    if staged.expert_shares():
        raise UsageError(f"--pipeline: {config.model.name} is a mixture-of-experts model; its router loss spans "
                         f"stages, which is not built yet")
    precision = resolve_precision(config.run.precision, weights_dtype(model))
    partition, _ = partition_for(staged, config, first_layer=first, precision=precision)
    blocks = [Block(b.start, b.stop, b.has_embed, b.has_head) for b in partition.blocks]
    shape = shape_from_config(model.config)
    r = config.run
    settings = Settings(seq_len=config.data.seq_len, micro_batch=config.data.batch_size // microbatches,
                        dtype=PRECISION_DTYPES[precision], recompute=r.recompute)
    stages = plan_stages(shape, settings, r.pipeline, blocks, microbatches, r.schedule, first)
    peaks = [stage_cost(shape, settings, stage, j, r.pipeline, blocks, microbatches, r.schedule)
             for j, stage in enumerate(stages)]
    return stages, peaks, precision


def run_pipeline_bcd(config: Config, resume: bool = False, quiet: bool = False) -> dict:
    """Train a whole model on a pipeline (prefix live) and write the run directory; returns the summary."""
    microbatches = check_flags(config)
    stages, peaks, precision = plan(config, microbatches)
    mesh, staged, notes = start(config, stages, peaks, microbatches, resume)
    if config.pre_inference.mode == "auto":
        notes.append("pre-inference auto: a pipeline run trains live (its sweep planner is not built for pipelines; "
                     "--pre-inference on reads a store for every visit above the input)")
    data = load_datasets(config, quiet)
    partition, active = partition_for(staged, config, precision=precision)
    shard = samples_per_shard(config, staged)
    chosen = live_sources(data, config, shard, mesh.replica, mesh.replicas)
    if config.pre_inference.mode == "on":
        chosen = PipelineStores(staged, stages, mesh, {"train": data.train, "eval": data.eval}, data.tokenizer,
                                config, chosen, shard, quiet)
    trainer = train(config, staged, partition, active, chosen, resume, quiet, notes, command="bcd",
                    make=trainer_for(config, mesh, stages, microbatches))
    if isinstance(chosen, PipelineStores):
        chosen.close()
    run = RunDir(config.run.out)

    def export(directory: Path) -> None:
        export_from_weights(config.model.name, run.checkpoint_weights, directory)
        data.tokenizer.save(directory)

    return finish_run(trainer, run, export)


def run_pipeline_train(config: Config, resume: bool = False, quiet: bool = False) -> dict:
    """Train the blocks above a cache's boundary K on a pipeline whose stages cut layers [K, L): the store
    feeds the first stage; the prefix is never loaded (only streamed once from the model's files for its
    digest)."""
    microbatches = check_flags(config)
    stores = open_cache(config.store.path, splits=["train", "eval"])
    boundary = int(stores["train"].fingerprint.parts["boundary"])
    notes = [check_prefix(stores["train"], prefix_digest(config.model.name, boundary, config.run.seed), config)]
    stages, peaks, precision = plan(config, microbatches, first=boundary)
    mesh, staged, started = start(config, stages, peaks, microbatches, resume)
    partition, active = partition_for(staged, config, first_layer=boundary, precision=precision)
    batch, seed = config.data.batch_size, config.run.seed
    chosen = LiveSources(
        ReaderBatches(stores["train"], boundary, batch, seed, mesh.replica, mesh.replicas),
        ReaderBatches(stores["eval"], boundary, batch, seed, shuffle=False,
                      limit=eval_samples(config.data.eval_tokens, stores["eval"].fields["labels"].shape[0])),
    )
    trainer = train(config, staged, partition, active, chosen, resume, quiet, [*notes, *started],
                    command="train", make=trainer_for(config, mesh, stages, microbatches))
    run = RunDir(config.run.out)

    def export(directory: Path) -> None:
        if export_from_weights(config.model.name, run.checkpoint_weights, directory):
            tokenizer = model_tokenizer(config.model.tokenizer, config.model.name, config.model.chat_template)
            save_store_tokenizer(tokenizer.tokenizer, stores["train"], directory)

    return finish_run(trainer, run, export)


def start(config: Config, stages: list[Block], peaks: list[int], microbatches: int,
          resume: bool) -> tuple[PipelineMesh, preinfer.StagedModel, list[str]]:
    """Join the process group and the mesh (the world size checked first, the run directory next), load this
    rank's stage and set its precision; returns the mesh, the staged model and the run's first lines."""
    r = config.run
    rank, world = init_distributed(r.device)
    replicas = check_degree(r.pipeline, world)
    if rank == 0:
        check_run_dir(RunDir(r.out), resume)
    mesh = make_mesh(r.pipeline, r.device)
    stage = stages[mesh.stage]
    model = load_modules(config.model.name, lambda s: s.stage_modules(stage.start, stage.stop, stage.embed,
                                                                        stage.head),
                         f"stage {mesh.stage}", seed=r.seed)
    staged = preinfer.stage(to_device(model, r.device))
    return mesh, staged, [set_precision(model, config), describe_stages(stages, peaks, replicas, microbatches,
                                                                        r.schedule)]


def trainer_for(config: Config, mesh: PipelineMesh, stages: list[Block], microbatches: int):
    """What `train` builds its trainer with."""
    return partial(PipelineTrainer, mesh=mesh, stages=stages, microbatches=microbatches,
                   schedule=config.run.schedule)
