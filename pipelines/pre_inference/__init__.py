"""Pre-inference inside a BCD run: the executor of the sweep plans of `sweep_plan`, and keeping the stores it makes
valid. It serves the one run path (`pipelines.training`) and the pipeline's stages alike.

For a visit of a block starting at layer k > 0, `on` trains from a store at boundary k and `off` runs the prefix
live. At the start of every sweep, `auto` prices whole-sweep plans (which visits read a store, how each store
is made: from the input, rolled forward from a lower store, or reused; when each is deleted; the disk at the
plan's peak) against running the sweep live, with the throughputs measured in this run, and follows the
cheaper; `on` follows the plan in which every visit above the input reads a store, and builds no store that no
visit reads. The throughputs of stores are measured over every store made so far (`rates.Tally`); when one moves by
more than `sweep_plan.REVISE_MARGIN` from the one a plan assumed, the rest of the sweep is planned again. Every
plan, and at the end of each sweep its predicted against its measured seconds, is logged with its numbers
(metrics.jsonl and one line each).

A store is used only while its fingerprint matches the current prefix: a store the plan expected is checked
before it is read, and made again if stale. Stores are made by the same code as `preinfer cache`. Stores no
longer usable, or no longer read by the plan, are deleted unless `keep_stores`.

One executor serves every layout: one process, data-parallel ranks and a pipeline's stages all run `PreInference`;
what differs is how a store is made, the `StoreWriter` it is given (`writers.LocalWriter` by default; a
pipeline's stages make each store together, `stage_writer.StageWriter`, from the input only).

Modules: `sweep_plan` (the plans, pure), `executor` (`PreInference`, following the plan), `stores` (the stores
made, checked and deleted), `writers` (how the processes make a store), `stage_writer` (how a pipeline's stages
make one), `probe` (the first estimates: a layer's forward, the disk), `rates` (the throughputs measured in this
run) and `ranks` (the numbers the ranks agree on).
"""

from pipelines.pre_inference.executor import PreInference

__all__ = ["PreInference"]
