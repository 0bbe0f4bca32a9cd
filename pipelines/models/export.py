"""Writing a trained model as a complete `save_pretrained` directory: the tensors in memory, and those that are
not (a prefix below a store, on the meta device) copied from the source model's files; a model whose masters are
memory-mapped (`--masters disk`) tensor by tensor into shards of at most `SHARD_BYTES`. Each writes into a fresh
directory, which the run publishes whole (`preinfer.atomic_write.write_directory_atomically`: the files made
durable with the umask's mode, then renamed into place), so a crash never leaves a part of an export."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from preinfer.mapped_masters import write_safetensors
from preinfer.precision import cast_weights, weights_dtype
from preinfer.presets import PRESETS
from pipelines.models.suffix import Suffix, config_and_files, meta_model
from pipelines.models.tensor_files import TensorFiles, persistent_tensors, tensor_aliases


def export_full(suffix: Suffix, out: Path) -> bool:
    """Write a complete save_pretrained directory in the model's resident dtype: trained suffix from memory, prefix
    copied from the source files. False (nothing written) when the prefix is not available."""
    model = suffix.model
    tensors: dict[str, torch.Tensor] = {}
    aliases = tensor_aliases(model)
    seen: set[int] = set()
    for name, tensor in persistent_tensors(model):
        if id(tensor) in seen:
            continue
        seen.add(id(tensor))
        if not tensor.is_meta:
            tensors[name] = tensor.detach().contiguous()
            continue
        source = suffix.files.find(aliases[id(tensor)]) if suffix.files is not None else None
        if source is None:
            return False
        tensors[name] = suffix.files.get(source).to(tensor.dtype)
    out.mkdir(parents=True, exist_ok=True)
    model.config.dtype = weights_dtype(model)
    model.config.save_pretrained(out)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return True


SHARD_BYTES = 5 * 2**30  # the shard size of transformers' `save_pretrained`


def export_streamed(model: nn.Module, out: Path, shard_bytes: int = SHARD_BYTES) -> None:
    """The whole model as a save_pretrained directory, written tensor by tensor (each stored tensor once, under its
    first name) into `model.safetensors`, or into shards with an index when it holds more than `shard_bytes`; no
    more than one tensor's bytes are copied at a time."""
    named: dict[int, tuple[str, torch.Tensor]] = {}
    for name, tensor in persistent_tensors(model):
        named.setdefault(id(tensor), (name, tensor))
    shards: list[list[tuple[str, torch.Tensor]]] = [[]]
    size = total = 0
    for name, tensor in named.values():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append((name, tensor))
        size, total = size + nbytes, total + nbytes
    model.config.dtype = weights_dtype(model)
    model.config.save_pretrained(out)
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(out)
    if len(shards) == 1:
        write_safetensors(out / "model.safetensors", shards[0])
        return
    weight_map = {}
    for number, shard in enumerate(shards, 1):
        file = f"model-{number:05d}-of-{len(shards):05d}.safetensors"
        write_safetensors(out / file, shard)
        weight_map.update({name: file for name, _ in shard})
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def export_pretrained(model: nn.Module, out: Path) -> None:
    """The whole model in memory as transformers' `save_pretrained` writes it."""
    model.save_pretrained(out)


def export_from_weights(spec: str, weights: Path, out: Path) -> bool:
    """A save_pretrained directory of the model `spec` with every tensor read by name from `weights` (a
    pipeline run's gathered stages), and those `weights` lacks (the prefix below a store) from `spec`'s own
    files; False (nothing written) when they are not there (a preset's prefix)."""
    model = meta_model(spec)
    own = [] if spec in PRESETS else config_and_files(spec)[1].files
    files = TensorFiles([*own, weights])  # a name in both: the trained tensor
    cast_weights(model, TensorFiles([weights]).dtype())
    return export_full(Suffix(model, 0, None, files), out)
