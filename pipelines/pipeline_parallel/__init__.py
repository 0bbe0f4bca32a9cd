"""Pipeline-parallel BCD across processes (`preinfer bcd --pipeline N`, `train --store --pipeline N`) on
torch.distributed.pipelining: `mesh` (the pipeline x data process mesh), `stage_module` (one stage's layers as a
module), `visit` (one visit's way through the stages, and the `StageLink` over which
`pipelines.pre_inference.stage_writer` makes pre-inference's stores), `stage` (`StageLayout`: the seams of
`preinfer.layout.Layout` one stage implements for the one trainer), `layout` (what the one run path,
`pipelines.training.run`, asks of a pipeline run)."""
