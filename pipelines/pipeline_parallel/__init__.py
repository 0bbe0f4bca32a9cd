"""Pipeline-parallel BCD across processes (`preinfer bcd --pipeline N`, `train --store --pipeline N`) on torch.distributed.pipelining:
`mesh` (the pipeline x data process mesh), `stage_module` (one stage's layers as a module), `visit` (one
visit's way through the stages), `trainer` (the BCD trainer on a stage), `run` (the command's run)."""

from pipelines.pipeline_parallel.run import run_pipeline_bcd, run_pipeline_train

__all__ = ["run_pipeline_bcd", "run_pipeline_train"]
