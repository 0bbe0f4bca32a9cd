"""Which weights each rank of a run loads, trains and exports, as the one run path (`pipelines.training.runner.run`)
asks (`Placement`): `WholeModel` holds the whole model (or the suffix above a store) in each process, one or
data-parallel replicas under torchrun; `pipelines.pipeline_parallel.placement.PipelinePlacement` holds one stage of
a pipeline per rank. Each reads the run's `ParallelDims` (built once, by the runner), hands the trainer the step's
seams (`seams`: a `preinfer.seams.Seams`) and the run's precision, resolved once (`precision`)."""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from torch import nn

import preinfer
from preinfer.batch_source import LiveSources, VisitSources
from preinfer.config import Config
from preinfer.device_placement import host_tensors
from preinfer.errors import UsageError
from preinfer.mapped_masters import MappedMasters, MappedSeams
from preinfer.moe import EXPERTS_IN_ONE_PROCESS
from preinfer.parallel_dims import ParallelDims
from preinfer.precision import Precision, resolve_precision, weights_dtype
from preinfer.seams import Seams, replica_seams
from pipelines.models import resolve_model
from pipelines.models.export import export_full, export_pretrained, export_streamed
from pipelines.models.mapped import load_mapped
from pipelines.models.suffix import Suffix, load_suffix, to_device
from pipelines.pre_inference import PreInference
from pipelines.data.run_data import Datasets


class Placement(Protocol):
    """Which weights this rank loads, trains and exports, and how its visits are fed."""

    dims: ParallelDims

    def load(self, first: int) -> nn.Module:
        """This rank's part of the model, above boundary `first`, on the run's device."""
        ...

    def precision(self, model: nn.Module) -> Precision:
        """The run's precision, resolved once."""
        ...

    def seams(self, staged: preinfer.StagedModel) -> Seams:
        """The step's seams the trainer runs on."""
        ...

    def notes(self) -> list[str]:
        """Lines the run prints about where the model lives."""
        ...

    def prefix(self, boundary: int) -> Suffix:
        """The digest of the weights below `boundary` (checked against a store's)."""
        ...

    def pre_inference(self, staged: preinfer.StagedModel, data: Datasets, live: LiveSources,
                      shard: int, quiet: bool) -> VisitSources:
        """The sources of each visit."""
        ...

    def export(self, directory: Path) -> bool:
        """Write the trained model as a save_pretrained directory; False when it cannot be."""
        ...

    def close(self) -> None:
        """Clean up what the run made for itself."""
        ...


class WholeModel:
    """The model whole in every process; under torchrun each rank is a data-parallel replica."""

    def __init__(self, config: Config, dims: ParallelDims, resume: bool = False):
        """Refused with --experts on several replicas, before anything loads (`resume`: continuing the run in its
        directory)."""
        if config.blocks.experts is not None and dims.data > 1:
            raise UsageError(EXPERTS_IN_ONE_PROCESS)
        self.config, self.dims, self.resume = config, dims, resume
        self.model: nn.Module | None = None
        self.suffix: Suffix | None = None  # above a store's boundary
        self.masters: MappedMasters | None = None  # --masters disk

    def load(self, first: int) -> nn.Module:
        """The model, whole or above boundary `first` (the prefix on the meta device), loaded in host memory and
        then placed: what the run's device holds from the start moved there (`preinfer.device_placement`)."""
        run, model = self.config.run, self.config.model
        if model.masters == "disk":  # one process, from boundary 0 (`masters_problems`)
            self.model, self.masters = load_mapped(self.config, self.resume)
            loaded = self.model
        elif first == 0:
            loaded = self.model = resolve_model(model.name, run.seed, model.attention)
        else:
            self.suffix = load_suffix(model.name, first, run.seed, model.attention)
            loaded = self.suffix.model
        return to_device(loaded, run.device, host_tensors(preinfer.stage(loaded), self.config))

    def precision(self, model: nn.Module) -> Precision:
        """The run's precision: `run.precision`, auto following the loaded weights."""
        return resolve_precision(self.config.run.precision, weights_dtype(model))

    def seams(self, staged: preinfer.StagedModel) -> Seams:
        """What the trainer asks of one process (its masters on disk or not), or of a data-parallel replica."""
        if self.masters is not None:
            return MappedSeams(staged, self.config, self.masters)
        return replica_seams(staged, self.config, self.dims)

    def notes(self) -> list[str]:
        return []

    def prefix(self, boundary: int) -> Suffix:
        """The loaded suffix, with the digest of the weights below `boundary` (`load` was given it)."""
        return self.suffix

    def pre_inference(self, staged: preinfer.StagedModel, data: Datasets, live: LiveSources,
                      shard: int, quiet: bool) -> VisitSources:
        """The sources of each visit: live, or with pre-inference (`on`, `auto`) stores where they pay."""
        if self.config.pre_inference.mode == "off":
            return live
        return PreInference(staged, {"train": data.train, "eval": data.eval}, data.tokenizer, self.config, live,
                            shard, self.dims.replica, self.dims.data)

    def export(self, directory: Path) -> bool:
        """Write the trained model as a save_pretrained directory; False when a suffix's prefix is not at hand
        (`export_full`)."""
        if self.suffix is not None:
            return export_full(self.suffix, directory)
        if self.masters is not None:
            export_streamed(self.model, directory)
            return True
        export_pretrained(self.model, directory)
        return True

    def close(self) -> None:
        """Nothing is left to clean up (pre-inference deletes its stores as it goes)."""
