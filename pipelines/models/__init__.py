"""Model loading: everything that reads a model's weights.

- `source`: resolving `--model` (a preset, a `save_pretrained` directory or a BCD run directory) to a model;
- `pretrained`: a whole model from a preset or a `save_pretrained` directory;
- `suffix`: part of a model (the suffix from a boundary, a pipeline stage's modules) read tensor by tensor;
- `tensor_files`: safetensors files read by tensor name;
- `export`: writing a trained model, part of it copied from its source files, as a `save_pretrained` directory.
- `partition_choice`: which blocks a run trains (by the config, or the fewest that fit a memory budget).

Preset configs and building a preset from a seed are `preinfer.presets`; a model's config without its weights is
`preinfer.model_config` (the planner in `preinfer` reads it too).
"""

from pipelines.models.pretrained import load_model
from pipelines.models.source import ModelSource, is_run_dir, model_source, resolve_model

__all__ = ["ModelSource", "is_run_dir", "load_model", "model_source", "resolve_model"]
