"""Safetensors files read by tensor name, and the names a model's tensors go by."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from preinfer.errors import UsageError, first_line


SAFETENSORS_FLOATS = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "F64": torch.float64}


class TensorFiles:
    """Read-only access by name to the tensors of one or more safetensors files."""

    def __init__(self, files: list[Path]):
        self.files = files
        self.where: dict[str, Path] = {}
        for file in files:
            try:
                with safe_open(str(file), "pt") as f:
                    for key in f.keys():
                        self.where[key] = file
            except (OSError, SafetensorError) as err:
                raise UsageError(f"cannot read the weights in {file}: {first_line(err)}") from None

    @classmethod
    def of_directory(cls, directory: Path) -> TensorFiles:
        """The weight files of a save_pretrained directory (single file or sharded with an index)."""
        index = directory / "model.safetensors.index.json"
        if index.is_file():
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            return cls([directory / name for name in names])
        if (directory / "model.safetensors").is_file():
            return cls([directory / "model.safetensors"])
        raise UsageError(f"{directory} holds no model.safetensors (or index): cannot load a suffix from it")

    def find(self, aliases: list[str]) -> str | None:
        return next((name for name in aliases if name in self.where), None)

    def get(self, name: str) -> torch.Tensor:
        with safe_open(str(self.where[name]), "pt") as f:
            return f.get_tensor(name)

    def dtype(self) -> torch.dtype:
        """The dtype of the first floating-point tensor (what `from_pretrained` loads the model in)."""
        for name, file in self.where.items():
            with safe_open(str(file), "pt") as f:
                kind = f.get_slice(name).get_dtype()
            if kind in SAFETENSORS_FLOATS:
                return SAFETENSORS_FLOATS[kind]
        return torch.float32


def tensor_aliases(model: nn.Module) -> dict[int, list[str]]:
    """Tensor id -> every name it goes by (tied weights have several), first name first."""
    names: dict[int, list[str]] = {}
    for name, tensor in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
        names.setdefault(id(tensor), []).append(name)
    return names


def persistent_tensors(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) of every tensor the state dict saves, each alias of a tied weight included."""
    keys = set(model.state_dict().keys())
    named = [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]
    return [(name, t) for name, t in named if name in keys]
