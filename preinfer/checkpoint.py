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
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from preinfer.errors import CheckpointError, DivergedError, PreinferError, first_line

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
    atomically replaces `path`. Weights that are not finite are refused: the checkpoint before stays."""
    _refuse_non_finite(model, trainer_state.get("global_step"))
    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file(resident_state(model), str(tmp / WEIGHTS), metadata={"format": "pt"})
    tensors, optim_meta = {}, {}
    for block, state in optimizers.items():
        optim_meta[str(block)] = _flatten_optimizer(state, f"optim.{block}", tensors)
    for index, master in enumerate(masters):
        tensors[f"master.{index}"] = master.detach().contiguous()
    tensors["rng.torch"] = torch.get_rng_state()
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
    meta = _read_state(path / STATE)
    tensors = read_tensors(path / TENSORS)
    load_resident_state(model, read_tensors(path / WEIGHTS), path / WEIGHTS)
    missing = [name for name in ["rng.torch", *(f"master.{i}" for i in range(meta["masters"]))] if name not in tensors]
    if missing:
        raise CheckpointError(f"{path / TENSORS} lacks {missing[0]}; the run cannot resume from this checkpoint")
    try:
        optimizers = {int(b): _unflatten_optimizer(m, f"optim.{b}", tensors) for b, m in meta["optimizers"].items()}
        torch.set_rng_state(tensors["rng.torch"])
        _restore_host_rng(meta["rng"])
    except (KeyError, TypeError, ValueError, IndexError, RuntimeError) as err:
        raise CheckpointError(f"{path / STATE}: optimizers or rng do not fit the checkpoint's tensors ({err!r:.80}); "
                              f"the run cannot resume from this checkpoint") from None
    masters = [tensors[f"master.{index}"] for index in range(meta["masters"])]
    return Checkpoint(optimizers, meta["trainer"], masters)


# The top-level fields of state.json and their JSON types.
STATE_FIELDS = {"trainer": dict, "optimizers": dict, "masters": int, "rng": dict}


def _read_state(file: Path) -> dict:
    """state.json, its top-level fields checked (the trainer's own by `Progress.from_state`)."""
    try:
        meta = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CheckpointError(f"{file} is not readable JSON ({err}); the run cannot resume from it") from None
    if not isinstance(meta, dict):
        raise CheckpointError(f"{file}: expected a JSON object, got {type(meta).__name__}")
    meta.setdefault("masters", 0)
    for key, kind in STATE_FIELDS.items():
        value = meta.get(key)
        if not isinstance(value, kind) or isinstance(value, bool) or (kind is int and value < 0):
            raise CheckpointError(f"{file}: {key} = {value!r:.60}: expected "
                                  f"{'an integer >= 0' if kind is int else 'a JSON object'}")
    return meta


def read_tensors(file: Path) -> dict[str, torch.Tensor]:
    """A checkpoint's safetensors file; a damaged one is a CheckpointError naming it."""
    try:
        return load_file(str(file))
    except (OSError, SafetensorError) as err:
        raise CheckpointError(f"{file} is damaged ({first_line(err)}); the run cannot resume from this "
                              f"checkpoint") from None


def _refuse_non_finite(model: nn.Module, step: int | None) -> None:
    """A DivergedError naming the first weight with a NaN or infinity."""
    floats = [(name, t) for name, t in _resident(model).items() if t.is_floating_point()]
    if not floats or bool(torch.stack([t.isfinite().all() for _, t in floats]).all()):
        return
    name = next(name for name, t in floats if not bool(t.isfinite().all()))
    raise DivergedError(f"training diverged: weight {name} is not finite after step {step}; no checkpoint of it "
                        f"was written (the run directory keeps its last one); start again with a lower --lr or "
                        f"with --grad-clip")


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
