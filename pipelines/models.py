"""Resolving `--model`: a preset, a `save_pretrained` directory, or a BCD run directory (its current weights)."""

from __future__ import annotations

from pathlib import Path

from safetensors.torch import load_file
from torch import nn

from preinfer.checkpoint import WEIGHTS, load_resident_state
from preinfer.config import Config, load_config
from preinfer.presets import load_model


def is_run_dir(spec: str) -> bool:
    return (Path(spec) / "config.toml").is_file() and (Path(spec) / "checkpoint" / WEIGHTS).is_file()


def run_config(run_dir: str) -> Config:
    return load_config(Path(run_dir) / "config.toml")


def resolve_model(spec: str, seed: int = 0) -> nn.Module:
    """The model `spec` names; a run directory gives its current weights: its export when that is up to date
    (a finished run, also one trained from a store), else its base model with the checkpoint's weights."""
    export, checkpoint = Path(spec) / "export" / "config.json", Path(spec) / "checkpoint" / WEIGHTS
    if is_run_dir(spec) and export.is_file() and export.stat().st_mtime >= checkpoint.stat().st_mtime:
        return load_model(str(export.parent), seed=seed)
    if is_run_dir(spec):
        config = run_config(spec)
        model = load_model(config.model.name, seed=config.run.seed)
        weights = Path(spec) / "checkpoint" / WEIGHTS
        load_resident_state(model, load_file(str(weights)), weights)
        return model
    return load_model(spec, seed=seed)
