"""Run checkpoints without pickle: weights and tensors in safetensors, everything else in JSON."""

from __future__ import annotations

import json
import os
import random
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from preinfer.errors import PreinferError

WEIGHTS, TENSORS, STATE = "model.safetensors", "state.safetensors", "state.json"


@dataclass
class Checkpoint:
    """What a checkpoint restores besides the weights: optimizer states by block, the trainer's state, and
    (mid-visit under mixed precision) the active block's fp32 masters."""

    optimizers: dict[int, dict]
    trainer: dict
    masters: list[torch.Tensor] = field(default_factory=list)


def save_checkpoint(path: Path, model: nn.Module, optimizers: dict[int, dict], trainer_state: dict,
                    masters: list[torch.Tensor] = ()) -> None:
    """Write weights, optimizer states (by block), the active block's masters, trainer state and RNG states;
    atomically replaces `path`."""
    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file(resident_state(model), str(tmp / WEIGHTS), metadata={"format": "pt"})
    tensors, optim_meta = {}, {}
    for block, state in optimizers.items():
        optim_meta[str(block)] = _flatten_optimizer(state, f"optim.{block}", tensors)
    for index, master in enumerate(masters):
        tensors[f"master.{index}"] = master.detach().contiguous()
    tensors.update(_torch_rng_states())
    save_file(tensors, str(tmp / TENSORS))
    meta = {"trainer": trainer_state, "optimizers": optim_meta, "masters": len(masters), "rng": _host_rng_state()}
    (tmp / STATE).write_text(json.dumps(meta, indent=1))
    _fsync_dir(tmp)
    old = path.with_name(path.name + ".old")
    if path.exists():
        path.rename(old)
    tmp.rename(path)
    shutil.rmtree(old, ignore_errors=True)


def load_checkpoint(path: Path, model: nn.Module) -> Checkpoint:
    """Load weights into `model` and restore RNG states; returns the rest."""
    if not (path / STATE).is_file():
        raise PreinferError(f"no checkpoint in {path} (expected {STATE}); start without --resume")
    load_resident_state(model, load_file(str(path / WEIGHTS)), path / WEIGHTS)
    tensors = load_file(str(path / TENSORS))
    meta = json.loads((path / STATE).read_text())
    _restore_torch_rng(tensors)
    _restore_host_rng(meta["rng"])
    optimizers = {int(b): _unflatten_optimizer(m, f"optim.{b}", tensors) for b, m in meta["optimizers"].items()}
    masters = [tensors[f"master.{index}"] for index in range(meta.get("masters", 0))]
    return Checkpoint(optimizers, meta["trainer"], masters)


def resident_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every stored tensor of the model that has storage (a suffix-only model's meta prefix is left out), each
    once under its first name (a tied weight is saved once)."""
    return {name: tensor.detach().contiguous() for name, tensor in _resident(model).items()}


def _resident(model: nn.Module) -> dict[str, torch.Tensor]:
    keys = set(model.state_dict().keys())
    named = [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]
    state: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, tensor in named:
        if name in keys and id(tensor) not in seen and not tensor.is_meta:
            seen.add(id(tensor))
            state[name] = tensor
    return state


def load_resident_state(model: nn.Module, tensors: dict[str, torch.Tensor], source: Path) -> None:
    """Copy saved tensors into the model in place; the saved names must be exactly the model's resident ones."""
    expected = _resident(model)
    if set(expected) != set(tensors):
        extra, missing = sorted(set(tensors) - set(expected)), sorted(set(expected) - set(tensors))
        raise PreinferError(f"{source} does not fit this model (unexpected {extra[:3]}, missing {missing[:3]})")
    with torch.no_grad():
        for name, tensor in tensors.items():
            expected[name].copy_(tensor)


def _flatten_optimizer(state_dict: dict, prefix: str, tensors: dict[str, torch.Tensor]) -> dict:
    """Move the tensors of an optimizer state dict into `tensors`; returns the JSON-able rest."""
    scalars: dict[str, dict] = {}
    for index, entries in state_dict["state"].items():
        for key, value in entries.items():
            if torch.is_tensor(value):
                tensors[f"{prefix}.{index}.{key}"] = value.detach().contiguous()
            else:
                scalars.setdefault(str(index), {})[key] = value
    return {"param_groups": state_dict["param_groups"], "scalars": scalars, "indices": list(state_dict["state"])}


def _unflatten_optimizer(meta: dict, prefix: str, tensors: dict[str, torch.Tensor]) -> dict:
    state: dict[int, dict] = {int(i): dict(meta["scalars"].get(str(i), {})) for i in meta["indices"]}
    for name, value in tensors.items():
        if name.startswith(prefix + "."):
            index, key = name[len(prefix) + 1 :].split(".", 1)
            state[int(index)][key] = value
    return {"state": state, "param_groups": meta["param_groups"]}


def _torch_rng_states() -> dict[str, torch.Tensor]:
    """torch's generator states as tensors: the CPU one (`rng.torch`) and, where CUDA is in use, every CUDA
    device's (`rng.cuda.<i>`), so that a resume on accelerators draws what the uninterrupted run would."""
    states = {"rng.torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.device_count() > 0:
        states.update({f"rng.cuda.{i}": state for i, state in enumerate(torch.cuda.get_rng_state_all())})
    return states


def _restore_torch_rng(tensors: dict[str, torch.Tensor]) -> None:
    """Set the generator states `_torch_rng_states` saved: the CPU one, and each CUDA device's that this machine
    has (a checkpoint written without CUDA leaves the CUDA generators as they are)."""
    torch.set_rng_state(tensors["rng.torch"])
    saved = sum(1 for name in tensors if name.startswith("rng.cuda."))
    if saved and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([tensors[f"rng.cuda.{i}"] for i in range(min(saved, torch.cuda.device_count()))])


def _host_rng_state() -> dict:
    version, internal, gauss = random.getstate()
    np_state = np.random.get_state()
    return {
        "python": [version, list(internal), gauss],
        "numpy": [np_state[0], np_state[1].tolist(), *np_state[2:]],
    }


def _restore_host_rng(state: dict) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, *rest = state["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), *rest))


def _fsync_dir(path: Path) -> None:
    for child in path.iterdir():
        with child.open("rb") as f:
            os.fsync(f.fileno())
