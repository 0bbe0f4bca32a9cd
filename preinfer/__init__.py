"""preinfer, the model side: staged models, partitions, schedules, the BCD trainer, fingerprints, memory."""

from preinfer.errors import PreinferError, UnsupportedModelError, UsageError
from preinfer.staged import StagedModel, stage
from preinfer.state import BoundaryState

__all__ = ["BoundaryState", "PreinferError", "StagedModel", "UnsupportedModelError", "UsageError", "stage"]
