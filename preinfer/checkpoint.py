"""Run checkpoints without pickle: weights and tensors in safetensors, everything else in JSON.

A checkpoint is written whole into `checkpoint.tmp/`, its files' sha256 recorded last in `digest.json`; then the
previous checkpoint is renamed to `checkpoint.old/`, the new one to `checkpoint/`, and the old one deleted. A kill
at any point leaves a complete checkpoint behind: `newest_checkpoint` picks the newest of the three whose files
match their recorded digest, and the next save starts from there.
"""

from __future__ import annotations

import hashlib
import json
import random
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from preinfer.atomic_write import fsync_directory, write_atomically
from preinfer.errors import CheckpointError, CheckpointWriteError, DivergedError, PreinferError, first_line

WEIGHTS, TENSORS, STATE, DIGEST = "model.safetensors", "state.safetensors", "state.json", "digest.json"


@dataclass
class Checkpoint:
    """What a checkpoint restores besides the weights: optimizer states by block, the trainer's state, and
    (mid-visit under mixed precision) the active block's fp32 masters, and (mid-visit, data parallel) the state of
    how the replicas sync: the outer step's (`preinfer.replica_sync`) or PowerSGD's (`preinfer.grad_compression`)."""

    optimizers: dict[int, dict]
    trainer: dict
    masters: list[torch.Tensor] = field(default_factory=list)
    sync: list[torch.Tensor] = field(default_factory=list)
    weights: set[str] = field(default_factory=set)  # the names of the weights it held


def save_checkpoint(path: Path, model: nn.Module, optimizers: dict[int, dict], trainer_state: dict,
                    masters: list[torch.Tensor] = (), sync: list[torch.Tensor] = (), mapped: set[str] = frozenset(),
                    files: dict[str, dict] | None = None) -> None:
    """Write weights, optimizer states (by block), the active block's masters, the replicas' sync state, trainer
    state and RNG states; atomically replaces `path` (see the module's docstring). Weights that are not finite are
    refused: the checkpoint before stays. Masters on disk (`preinfer.mapped_masters`): the weights named in
    `mapped` equal their files and are left out, and state.json records `files`, the run's own files of them."""
    weights = {name: t for name, t in resident_state(model).items() if name not in mapped}
    refuse_non_finite(weights, f"after step {trainer_state.get('global_step')}")
    tmp, old = _sibling(path, ".tmp"), _sibling(path, ".old")
    try:
        _settle(path)
        for leftover in (tmp, old):  # a killed save's: the newest complete checkpoint is at `path` now
            shutil.rmtree(leftover, ignore_errors=True)
    except OSError as err:
        raise _write_failed(path, path, err) from None
    try:
        _write_whole(tmp, weights, optimizers, trainer_state, masters, sync, files or {})
    except (OSError, SafetensorError) as err:
        shutil.rmtree(tmp, ignore_errors=True)  # incomplete: its space back, the checkpoint before kept
        raise _write_failed(tmp, path, err) from None
    try:
        if path.exists():
            _retire(path, old)
        _publish(tmp, path)
    except OSError as err:  # the new checkpoint is complete in `tmp`, or the previous one in `old`
        raise _write_failed(path, path, err) from None
    shutil.rmtree(old, ignore_errors=True)


def _write_whole(tmp: Path, weights: dict[str, torch.Tensor], optimizers: dict[int, dict], trainer_state: dict,
                 masters: list[torch.Tensor], sync: list[torch.Tensor], files: dict[str, dict]) -> None:
    """Write a whole checkpoint into `tmp`, its digest last."""
    tmp.mkdir(parents=True)
    write_atomically(tmp / WEIGHTS, lambda file: save_file(weights, str(file), metadata={"format": "pt"}))
    tensors, optim_meta = {}, {}
    for block, state in optimizers.items():
        optim_meta[str(block)] = _flatten_optimizer(state, f"optim.{block}", tensors)
    for prefix, listed in (("master", masters), ("sync", sync)):
        tensors.update({f"{prefix}.{index}": tensor.detach().contiguous() for index, tensor in enumerate(listed)})
    tensors.update(_torch_rng_states())
    write_atomically(tmp / TENSORS, lambda file: save_file(tensors, str(file)))
    meta = {"trainer": trainer_state, "optimizers": optim_meta, "masters": len(masters), "sync": len(sync),
            "rng": _host_rng_state(), "mapped": files}
    write_atomically(tmp / STATE, json.dumps(meta, indent=1))
    _write_digest(tmp)


def _write_failed(where: Path, path: Path, err: Exception) -> CheckpointWriteError:
    """The error of a save that failed writing `where`: whether (and where) a complete checkpoint of `path` is
    kept to resume from."""
    kept = newest_checkpoint(path)
    reason = getattr(err, "strerror", None) or first_line(err)
    state = f"the last complete checkpoint is kept in {kept}" if kept else "no complete checkpoint was written yet"
    return CheckpointWriteError(f"writing the checkpoint {where} failed ({reason}); {state}")


def newest_checkpoint(path: Path) -> Path | None:
    """The directory to resume the checkpoint `path` from: the newest complete one of `path.tmp` (a save killed
    before its renames), `path` and `path.old` (killed between them); None if none is complete."""
    for candidate in (_sibling(path, ".tmp"), path, _sibling(path, ".old")):
        if is_complete(candidate, legacy=candidate != _sibling(path, ".tmp")):
            return candidate
    return None


def is_complete(path: Path, legacy: bool = False) -> bool:
    """Whether `path` holds a whole checkpoint: every file its digest record lists, with that sha256. `legacy`:
    a checkpoint written before digests were recorded counts by its state file (only ever renamed into place
    whole)."""
    try:
        recorded = json.loads((path / DIGEST).read_text())
    except FileNotFoundError:
        return legacy and (path / STATE).is_file() and (path / WEIGHTS).is_file()
    except (OSError, ValueError):
        return False
    if not isinstance(recorded, dict) or set(recorded) != {WEIGHTS, TENSORS, STATE}:
        return False
    return all(_sha256(path / name) == digest for name, digest in recorded.items())


def _retire(path: Path, old: Path) -> None:
    """Move the previous checkpoint aside (the first rename of a save)."""
    path.rename(old)


def _publish(tmp: Path, path: Path) -> None:
    """Put the new checkpoint in place, durably (the second rename of a save)."""
    tmp.rename(path)
    fsync_directory(path.parent)


def _settle(path: Path) -> None:
    """Put the newest complete checkpoint at `path` before a save replaces it (a killed save may have left it in
    `path.tmp` or only `path.old`); what is not complete is dropped."""
    newest = newest_checkpoint(path)
    if newest is None or newest == path:
        return
    if path.exists():
        shutil.rmtree(path)
    _publish(newest, path)


def load_checkpoint(path: Path, model: nn.Module, mapped: set[str] = frozenset()) -> Checkpoint:
    """Load weights into `model` and restore RNG states from the newest complete checkpoint at `path` (see
    `newest_checkpoint`); returns the rest. `mapped`: weights the checkpoint may leave out (masters on disk)."""
    found = newest_checkpoint(path)
    if found is None and path.is_dir():
        raise _why_incomplete(path)
    if found is None:
        raise PreinferError(f"no complete checkpoint in {path} (expected {STATE}); start without --resume")
    meta = _read_state(found / STATE)
    tensors = read_tensors(found / TENSORS)
    weights = read_tensors(found / WEIGHTS)
    load_resident_state(model, weights, found / WEIGHTS, mapped)
    listed = [*(f"master.{i}" for i in range(meta["masters"])), *(f"sync.{i}" for i in range(meta["sync"]))]
    missing = [name for name in ["rng.torch", *listed] if name not in tensors]
    if missing:
        raise CheckpointError(f"{found / TENSORS} lacks {missing[0]}; the run cannot resume from this checkpoint")
    try:
        optimizers = {int(b): _unflatten_optimizer(m, f"optim.{b}", tensors) for b, m in meta["optimizers"].items()}
        _restore_torch_rng(tensors)
        _restore_host_rng(meta["rng"])
    except (KeyError, TypeError, ValueError, IndexError, RuntimeError) as err:
        raise CheckpointError(f"{found / STATE}: optimizers or rng do not fit the checkpoint's tensors ({err!r:.80}); "
                              f"the run cannot resume from this checkpoint") from None
    masters = [tensors[f"master.{index}"] for index in range(meta["masters"])]
    sync = [tensors[f"sync.{index}"] for index in range(meta["sync"])]
    return Checkpoint(optimizers, meta["trainer"], masters, sync, set(weights))


def mapped_files(path: Path) -> dict[str, dict]:
    """The run's own master files the newest complete checkpoint at `path` records (`save_checkpoint`'s `files`);
    none without one."""
    found = newest_checkpoint(path)
    return _read_state(found / STATE)["mapped"] if found is not None else {}


# The top-level fields of state.json and their JSON types.
STATE_FIELDS = {"trainer": dict, "optimizers": dict, "masters": int, "sync": int, "rng": dict, "mapped": dict}


def _why_incomplete(path: Path) -> CheckpointError:
    """What is wrong with the checkpoint at `path`, which failed its digest: the first file that does not read as
    a checkpoint's, else the first whose sha256 is not the one recorded (changed after it was written)."""
    try:
        _read_state(path / STATE)
        for name in (TENSORS, WEIGHTS):
            read_tensors(path / name)
        recorded = json.loads((path / DIGEST).read_text())
    except CheckpointError as error:
        return error
    except (OSError, ValueError):
        return CheckpointError(f"{path / DIGEST} is missing or damaged; the run cannot resume from this checkpoint")
    changed = next((name for name, digest in recorded.items() if _sha256(path / name) != digest), DIGEST)
    return CheckpointError(f"{path / changed} does not match the sha256 recorded in {path / DIGEST} (changed after "
                           f"the checkpoint was written); the run cannot resume from this checkpoint")


def _read_state(file: Path) -> dict:
    """state.json, its top-level fields checked (the trainer's own by `RunPosition.from_state`)."""
    try:
        meta = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CheckpointError(f"{file} is not readable JSON ({err}); the run cannot resume from it") from None
    if not isinstance(meta, dict):
        raise CheckpointError(f"{file}: expected a JSON object, got {type(meta).__name__}")
    meta.setdefault("masters", 0)
    meta.setdefault("sync", 0)
    meta.setdefault("mapped", {})
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


def refuse_non_finite(weights: dict[str, torch.Tensor], when: str) -> None:
    """A DivergedError naming the first of `weights` with a NaN or infinity (`when`: after which step)."""
    floats = [(name, t) for name, t in weights.items() if t.is_floating_point()]
    devices = {t.device for _, t in floats}  # frozen weights held in fewer bits have their masters on the host
    if all(bool(torch.stack([t.isfinite().all() for _, t in floats if t.device == d]).all()) for d in devices):
        return
    name = next(name for name, t in floats if not bool(t.isfinite().all()))
    raise DivergedError(f"training diverged: weight {name} is not finite {when}; no checkpoint of it "
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


def load_resident_state(model: nn.Module, tensors: dict[str, torch.Tensor], source: Path,
                        mapped: set[str] = frozenset()) -> None:
    """Copy saved tensors into the model in place; the saved names must be exactly the model's resident ones (those
    in `mapped` may be left out)."""
    expected = _resident(model)
    extra, missing = sorted(set(tensors) - set(expected)), sorted(set(expected) - set(tensors) - set(mapped))
    if extra or missing:
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


def _sibling(path: Path, suffix: str) -> Path:
    return path.with_name(path.name + suffix)


def _sha256(path: Path) -> str | None:
    digest = hashlib.sha256()
    try:
        with path.open("rb") as f:
            while chunk := f.read(1 << 20):
                digest.update(chunk)
    except OSError:
        return None
    return digest.hexdigest()


def _write_digest(path: Path) -> None:
    """Record the sha256 of each file of the checkpoint being written at `path`, durably, as its last file."""
    record = {name: _sha256(path / name) for name in (WEIGHTS, TENSORS, STATE)}
    write_atomically(path / DIGEST, json.dumps(record))
