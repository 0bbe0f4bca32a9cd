"""The one run path of `preinfer bcd` and `preinfer train`: `run(config)` resolves the config into model, data,
partition and sources, trains, then writes the run directory (`preinfer.run_dir.RunDir`). The run's parallelism
(`preinfer.parallel_dims.ParallelDims`: its degrees and mesh) is built once, here; which weights each rank holds is
the placement's business: the whole model in one process or data-parallel replicas (`placement.WholeModel`), or a
pipeline of `run.pipeline` stages (`pipelines.pipeline_parallel.placement.PipelinePlacement`); the prefix runs live,
or a cache's stores (`store.path`) stand in for it (`store_input.StoreInput`). Everything a bad input can trip on
is resolved before the run directory is created, so a refused run leaves nothing behind.

SIGINT and SIGTERM during training finish the current step, write a checkpoint and end the process with exit code
128 + the signal number (130, 143) and one line saying how to resume; `--resume` then ends with the same weights
as an uninterrupted run. A second signal acts as usual."""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import torch
from torch import nn

import preinfer
from preinfer.batch_source import VisitSources
from preinfer.config import Config
from preinfer.config.resolved import check_resolved, resolve_run
from preinfer.expansion import widest_rank
from preinfer.model_config import local_config, skeleton
from preinfer.moe import sparse_blocks
from preinfer.parallel_dims import parallel_dims
from preinfer.partition import Partition
from preinfer.precision import Precision, resolve_precision, weights_dtype
from preinfer.run_dir import RunDir
from pipelines.data.tokenizer_choice import model_tokenizer
from pipelines.data.tokenizers import Tokenizer
from pipelines.training.distributed import init_distributed
from pipelines.training.fit import stopped_writing, train
from pipelines.training.placement import Placement, WholeModel
from pipelines.models.mapped import check_mapped_source
from pipelines.data.corpus import CorpusDigest
from pipelines.training.inputs import check_inputs, run_corpus
from pipelines.training.memory_check import check_memory
from pipelines.pre_inference.stores import owning_store_dir
from pipelines.models.partition_choice import partition_for
from pipelines.models.source import config_source, stored_dtype
from pipelines.training.run_directory import finish_run, owning_run
from pipelines.training.store_input import StoreInput
from pipelines.training.trackers import check_trackers
from pipelines.cache import samples_per_shard
from pipelines.data.run_data import live_sources, load_datasets


def run(config: Config, resume: bool = False, quiet: bool = False) -> dict:
    """Train as configured and write the run directory, held for the whole job; returns the summary."""
    check_trackers(config.run.report_to, config.run.out)  # a tracker not installed: refused before anything is made
    rank, world = init_distributed(config.run.device)
    check_mapped_source(config, world)
    run_dir = RunDir(config.run.out)
    with owning_run(run_dir, resume, rank), owning_store_dir(config, rank):  # held, then checked
        corpus = run_corpus(config)  # read once: for the inputs (recorded, or checked on resume) and the token store
        if resume and rank == 0:
            check_inputs(run_dir, config, corpus)
        return _run(config, run_dir, resume, quiet, corpus)


def _run(config: Config, run_dir: RunDir, resume: bool, quiet: bool, corpus: CorpusDigest | None) -> dict:
    store = StoreInput(config) if config.store.path is not None else None
    first = store.boundary if store is not None else 0
    placement = placement_for(config, first, resume)
    model, loaded, precision, staged, partition, active, resolved = resolve(config, placement, first)
    notes = [precision.describe(loaded), *placement.notes()]
    if store is not None:
        notes.append(store.check_prefix(placement.prefix(first), config))
    chosen, tokenizer = sources(config, placement, staged, store, quiet, corpus)
    command = "bcd" if store is None else "train"
    trainer = train(config, staged, partition, active, chosen, resume, quiet, notes, command=command,
                    seams=placement.seams(staged), precision=precision, corpus=corpus,
                    resolved=resolved)
    placement.close()

    def export(directory: Path) -> None:
        if not placement.export(directory):
            print(f"no export written: {config.model.name} has no weights below boundary {first} (a preset's prefix "
                  f"exists only as the store's states); the trained layers are in {run_dir.checkpoint_weights}")
            return
        if store is None:
            tokenizer.save(directory)
        else:
            store.save_tokenizer(tokenizer, directory)

    try:
        return finish_run(trainer, run_dir, export)
    except OSError as err:
        raise stopped_writing(err, command, run_dir) from None


class Resolution(NamedTuple):
    """The run loaded and resolved: its model (in its precision), staged and partitioned, and the run record."""

    model: nn.Module
    loaded: torch.dtype  # the dtype its weights were loaded in
    precision: Precision
    staged: preinfer.StagedModel
    partition: Partition
    active: int | None
    resolved: ResolvedRun


def resolve(config: Config, placement: Placement, first: int) -> Resolution:
    """Load the model as `placement` places it, resolve its precision (once: everything after reads it) and
    partition, and the run they make, judged by every rule (`check_resolved`: a rule of fp16-mixed holds for auto
    resolved to it); the rules of the model's structure first on its skeleton (`check_structure`), before it is
    loaded."""
    if first == 0 and config.run.pipeline == 1:
        check_structure(config)
    model = placement.load(first)
    loaded = weights_dtype(model)
    precision = placement.precision(model)
    precision.apply(model)
    staged = preinfer.stage(model)
    partition, active = partition_for(staged, config, first_layer=first, precision=precision)
    sparse = bool(sparse_blocks(staged.layers))
    checked = check_resolved(config, precision, blocks=len(partition), sparse=sparse, widest=widest_rank(staged))
    resolved = resolve_run(checked, precision, sparse=sparse, blocks=len(partition))
    return Resolution(model, loaded, precision, staged, partition, active, resolved)


def check_structure(config: Config) -> None:
    """The rules of the model's structure (its partition's size, its sparse layers) and of the precision `auto`
    resolves to, judged on the model built on the meta device and the dtype its weights are stored in: a run they
    refuse reads no weight and initialises no preset. A partition the memory budget chooses (`ufp` auto) is
    planned here in that precision, as the loaded run plans it; then the plan's largest visit is held against the
    device's memory (`check_memory`)."""
    source = config_source(config.model.name)
    staged = skeleton(local_config(source), source)
    precision = resolve_precision(config.run.precision, stored_dtype(config.model.name))
    partition, active = partition_for(staged, config, precision=precision)
    check_resolved(config, precision, blocks=len(partition), sparse=bool(sparse_blocks(staged.layers)),
                   widest=widest_rank(staged))
    check_memory(config, staged, partition, active, precision)


def sources(config: Config, placement: Placement, staged: preinfer.StagedModel,
            store: StoreInput | None, quiet: bool, corpus: CorpusDigest | None) -> tuple[VisitSources, Tokenizer]:
    """What each visit reads, and the tokenizer the export is saved with: a cache's stores, or the token store's
    splits of the corpus fingerprinted `corpus` (with pre-inference, as the placement runs it)."""
    if store is not None:
        m = config.model
        tokenizer = model_tokenizer(m.tokenizer, m.name, m.chat_template, m.chat_template_name).tokenizer
        return store.sources(config, placement.dims.replica, placement.dims.data), tokenizer
    data = load_datasets(config, quiet, corpus)
    shard = samples_per_shard(config, staged)
    live = live_sources(data, config, shard, placement.dims.replica, placement.dims.data)
    return placement.pre_inference(staged, data, live, shard, quiet), data.tokenizer


def placement_for(config: Config, first: int, resume: bool = False) -> Placement:
    """The run's placement: a pipeline when `run.pipeline` > 1 (its flags and stages checked first, before anything
    is loaded), else the whole model (`resume`: continuing the run in its directory); on the run's parallelism,
    built here, once."""
    r = config.run
    if r.pipeline > 1:
        from pipelines.pipeline_parallel.placement import PipelinePlacement, run_stages  # loads pipelining

        plan = run_stages(config, first)
        return PipelinePlacement(config, parallel_dims(r.pipeline, r.device), plan)
    return WholeModel(config, parallel_dims(1, r.device), resume)
