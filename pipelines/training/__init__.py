"""Training runs: `run(config, resume, quiet)` is the one entry point of `preinfer bcd` and `preinfer train`, in one
process, data-parallel or on a pipeline, the prefix live or from a cache's stores (`runner`).

Its parts, one concern a module: `store_input` (a cache's stores standing in for the prefix), `distributed`
(joining torchrun's process group), `placement` (which weights each rank loads and exports: `WholeModel`,
whose seams are `preinfer.seams`'s; the pipeline's is `pipelines.pipeline_parallel.placement`), `fit` (building the
trainer and fitting it), `signals` (stopping on SIGINT or SIGTERM), `progress` (the progress display), `run_directory` (the run
directory held, checked, created and finished), `inputs` (what a run was trained on). What the pipeline shares
with them lives outside: pre-inference (`pipelines.pre_inference`), a run's token data (`pipelines.data.run_data`),
its shard size (`pipelines.cache.samples_per_shard`) and its choice of blocks (`pipelines.models.partition_choice`)."""

from pipelines.training.fit import train
from pipelines.models.partition_choice import partition_for
from pipelines.training.run_directory import prepare_run_dir
from pipelines.training.runner import run
from pipelines.cache import samples_per_shard
from pipelines.data.run_data import live_sources, load_datasets

__all__ = ["live_sources", "load_datasets", "partition_for", "prepare_run_dir", "run", "samples_per_shard", "train"]
