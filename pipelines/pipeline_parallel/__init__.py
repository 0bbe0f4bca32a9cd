"""Pipeline-parallel BCD across processes (`preinfer bcd --pipeline N`, `train --store --pipeline N`) on
torch.distributed.pipelining, over the run's `preinfer.parallel_dims.ParallelDims` (the data x pipeline mesh):
`stage_module` (one stage's layers as a module), `visit` (one visit's way through the stages, and the `StageLink`
over which `pipelines.pre_inference.stage_writer` makes pre-inference's stores), `stage` (`StageSeams`: the step's
seams, `preinfer.seams.Seams`, one stage implements for the one trainer), `placement` (`PipelinePlacement`: what the
one run path, `pipelines.training.run`, asks of a pipeline run)."""
