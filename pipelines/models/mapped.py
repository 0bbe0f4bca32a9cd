"""The model of a `--masters disk` run, every weight memory-mapped (`preinfer.mapped_masters`): from the model
directory's safetensors files, then from the run's own files for the blocks a resumed run's checkpoint records;
refused in one line, before anything is made, where it cannot apply."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from preinfer.checkpoint import mapped_files
from preinfer.config import Config
from preinfer.errors import UsageError
from preinfer.mapped_masters import MappedMasters, map_file
from preinfer.model_config import check_stageable, local_config
from preinfer.precision import resolve_precision
from preinfer.presets import PRESETS
from preinfer.run_dir import RunDir
from pipelines.models.source import is_run_dir
from pipelines.models.suffix import load_from
from pipelines.models.tensor_files import TensorFiles, persistent_tensors


class MappedFiles(TensorFiles):
    """Safetensors files whose tensors are memory-mapped copy-on-write (a name in several: the last file's)."""

    def __init__(self, files: list[Path]):
        super().__init__(files)
        self.maps: dict[Path, dict[str, torch.Tensor]] = {}

    def get(self, name: str) -> torch.Tensor:
        file = self.where[name]
        if file not in self.maps:
            self.maps[file] = map_file(file)
        return self.maps[file][name]


def check_mapped_source(config: Config, world: int) -> None:
    """Refuse `--masters disk` where it cannot apply: a preset or a run directory as --model (no files of its own
    to map: a preset exists only in memory, a run directory's checkpoint holds part of a model), several
    processes, or a precision that would hold the weights in another dtype than their files' (a copy of each)."""
    if config.model.masters != "disk":
        return
    spec = config.model.name
    if spec in PRESETS:
        raise UsageError(f"--masters disk maps the weights of a model directory's safetensors files; preset '{spec}' "
                         f"has none: point --model at a save_pretrained directory, or use --masters host")
    if is_run_dir(spec):
        raise UsageError(f"--masters disk: --model {spec} is a run directory (its checkpoint holds only what its "
                         f"files do not): point --model at its export/, or use --masters host")
    if world > 1:
        raise UsageError("--masters disk maps and writes the masters in one process: run without torchrun, or use "
                         "--masters host")
    check_stageable(local_config(spec), spec)
    stored = TensorFiles.of_directory(Path(spec)).dtype()
    resident = resolve_precision(config.run.precision, stored).resident_dtype
    if resident != stored:
        names = [str(dtype).removeprefix("torch.") for dtype in (stored, resident)]
        raise UsageError(f"--masters disk maps the weights in the dtype of their files ({names[0]} in {spec}); "
                         f"--precision {config.run.precision} holds them in {names[1]}: choose a precision that "
                         f"holds {names[0]}, or use --masters host")


def load_mapped(config: Config, resume: bool) -> tuple[nn.Module, MappedMasters]:
    """The model with every weight mapped, and its masters: the run's files its checkpoint records (resuming), over
    the model directory's; `clean` names each tensor mapped as its file holds it."""
    run = RunDir(config.run.out)
    masters = MappedMasters.recorded(run, mapped_files(run.checkpoint)) if resume else \
        MappedMasters(run.masters, {}, ())
    spec = config.model.name
    files = MappedFiles([*TensorFiles.of_directory(Path(spec)).files, *masters.paths()])
    model = load_from(spec, files, config.model.attention)
    masters.clean = {name for name, tensor in _first_names(model).items() if files.find([name]) is not None
                     and files.get(name).data_ptr() == tensor.data_ptr()}
    return model, masters


def _first_names(model: nn.Module) -> dict[str, torch.Tensor]:
    """Each stored tensor under its first state-dict name."""
    named: dict[int, tuple[str, torch.Tensor]] = {}
    for name, tensor in persistent_tensors(model):
        named.setdefault(id(tensor), (name, tensor))
    return dict(named.values())
