"""preinfer, the model side: staged models, partitions, block orders, the BCD trainer, fingerprints, memory."""

import importlib

from preinfer.errors import PreinferError, UnsupportedModelError, UsageError

# Names loaded on first use: they import torch, which torch-free modules (the planner, the config) do not need.
_LAZY = {"StagedModel": "preinfer.staged", "stage": "preinfer.families", "BoundaryState": "preinfer.boundary_state"}

__all__ = ["BoundaryState", "PreinferError", "StagedModel", "UnsupportedModelError", "UsageError", "stage"]


def __getattr__(name: str) -> object:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'preinfer' has no attribute {name!r}")
