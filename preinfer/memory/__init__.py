"""The analytic memory and cost model of full-parameter Adam and BCD-Adam (live and from a pre-inference store),
and what it serves: the plan of `preinfer plan`, blocks chosen by a memory budget, the pipeline's stage cut, and the
meter that measures what the model predicts.

Every formula lives in this package, with its assumption beside it. Byte counts are per GPU and per micro-batch
step. Modules, from the inputs to the plan:

- `settings`: the GPU table, bytes per parameter of each dtype, and the plan's other inputs (`Settings`);
- `shapes`: the sizes of a model (`ModelShape`) from a size name, a preset or a Hugging Face config;
- `layer_spans`: runs of consecutive layers (`LayerSpan`) and the partition into blocks;
- `activations`: the bytes each layer saves for backward;
- `quantized`: what frozen weights in fewer bits, 8-bit moments and a fused step change in a visit;
- `footprint`: bytes per GPU of full Adam, of each BCD visit and of a pipeline stage, and the automatic
  partition (`best_fit`: the fewest visits that fit, the ends' placement too);
- `traffic`: a store's size and its traffic against a pipeline's;
- `cost`: training FLOPs, GPU-hours and dollars;
- `plan`: `MemoryPlan`, everything `preinfer plan` reports;
- `budget`: the automatic partition under a memory budget (`--ufp auto`), or what would fit;
- `stage_cut`: the layers cut into pipeline stages, and the plan's rows priced stage by stage;
- `meter`: the memory measured on real steps (imports torch; the rest does not).
"""
