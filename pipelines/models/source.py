"""Resolving `--model`: a preset, a `save_pretrained` directory, or a BCD run directory (its current weights).

`model_source` is the one place that tells a run directory from the others: commands take their defaults (data,
tokenizer, seed) from the run's config when `--model` names one.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from preinfer.checkpoint import load_resident_state, mapped_files, read_tensors
from preinfer.config import DEFAULT_ATTENTION, Config, load_config
from preinfer.mapped_masters import recorded_paths
from preinfer.model_config import local_config
from preinfer.presets import PRESETS
from preinfer.precision import cast_weights
from preinfer.run_dir import RunDir
from pipelines.models.pretrained import load_model
from pipelines.models.tensor_files import TensorFiles


@dataclass(frozen=True)
class ModelSource:
    """A model to load: `spec` as `--model` gave it, the seed that initialises a preset, and the attention
    implementation it runs."""

    spec: str
    seed: int
    attention: str = DEFAULT_ATTENTION

    def load(self) -> nn.Module:
        return resolve_model(self.spec, self.seed, self.attention)


def model_source(spec: str, seed: int | None = None, attention: str | None = None) -> tuple[ModelSource, Config | None]:
    """(the model to load, the run's config) for a run directory, else (the model, None); `seed` initialises a
    preset (None: the run's seed, else 0); `attention` None: the run's, else the default."""
    run = load_config(RunDir(spec).config) if is_run_dir(spec) else None
    chosen = seed if seed is not None else run.run.seed if run is not None else 0
    implementation = attention or (run.model.attention if run is not None else DEFAULT_ATTENTION)
    return ModelSource(spec, chosen, implementation), run


def is_run_dir(spec: str) -> bool:
    """`spec` is a run directory with a checkpoint."""
    return RunDir(spec).is_resumable()


def resolve_model(spec: str, seed: int = 0, attention: str = DEFAULT_ATTENTION) -> nn.Module:
    """The model `spec` names, running the `attention` implementation; a run directory gives its current weights:
    its export when that is up to date (a finished run, also one trained from a store), else its base model with
    the checkpoint's weights, in their dtype."""
    run = RunDir(spec)
    if run.export_is_current():
        return load_model(str(run.export), seed, attention)
    if run.is_resumable():
        config = load_config(run.config)
        model = load_model(config.model.name, config.run.seed, attention)
        weights = {name: t for file in run_files(run, config) for name, t in read_tensors(file).items()}
        cast_weights(model, next(t.dtype for t in weights.values() if t.is_floating_point()))
        on_disk = set(model.state_dict()) if config.model.masters == "disk" else set()
        load_resident_state(model, weights, run.checkpoint_weights, on_disk)
        return model
    return load_model(spec, seed, attention)


def config_source(spec: str) -> str:
    """The preset or model directory whose config is the model `spec` names (`resolve_model`'s choice: a run
    directory's current export, or its base model)."""
    run = RunDir(spec)
    if run.export_is_current():
        return str(run.export)
    if run.is_resumable():
        return config_source(load_config(run.config).model.name)
    return spec


def stored_dtype(spec: str) -> torch.dtype:
    """The dtype `resolve_model(spec)` loads the weights in, read without loading them: a preset's float32, a
    model directory's config `dtype` or else its first floating-point tensor's (transformers' `dtype="auto"`), a run
    directory's current export's, or its checkpoint's weights'."""
    run = RunDir(spec)
    if run.export_is_current():
        return stored_dtype(str(run.export))
    if run.is_resumable():
        return TensorFiles(run_files(run, load_config(run.config))).dtype()
    if spec in PRESETS:
        return torch.float32
    declared = local_config(spec).dtype
    if declared is not None:
        return getattr(torch, declared) if isinstance(declared, str) else declared
    weighed = any((Path(spec) / name).is_file() for name in ("model.safetensors", "model.safetensors.index.json"))
    return TensorFiles.of_directory(Path(spec)).dtype() if weighed else torch.float32  # the load refuses it


def run_files(run: RunDir, config: Config) -> list[Path]:
    """The files of a run's current weights over its base model's, a later one's tensor overriding: its
    checkpoint's weights, after (with `--masters disk`, whose checkpoint holds only what they do not) the files of
    the blocks it has trained."""
    trained = recorded_paths(run.masters, mapped_files(run.checkpoint)) if config.model.masters == "disk" else []
    return [*trained, run.checkpoint_weights]
