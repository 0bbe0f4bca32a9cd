"""Part of a model in memory: the suffix from boundary k (`load_suffix`; the prefix is never loaded) or any set of
its modules, such as a pipeline stage's (`load_modules`).

The model is built on the meta device (no storage), then only the tensors the part uses (for a suffix: layers >= k,
the head, shared modules such as rotary tables, and a tied embedding) are read from the weight files, one by one.
The prefix's fingerprint is hashed by streaming its tensors from the same files without keeping them.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedConfig

import preinfer
from preinfer.config import DEFAULT_ATTENTION, load_config
from preinfer.errors import UsageError
from preinfer.fingerprint import hash_tensors, named_prefix_tensors
from preinfer.precision import cast_weights
from preinfer.presets import PRESETS, build_preset, preset_config
from preinfer.run_dir import RunDir
from pipelines.models.source import is_run_dir, run_files
from pipelines.models.tensor_files import TensorFiles, persistent_tensors, tensor_aliases


@dataclass
class Suffix:
    model: nn.Module
    boundary: int
    prefix_digest: str | None  # None: the prefix's tensors are not in the model files
    files: TensorFiles | None  # where the prefix lives, for a full export; None for presets


def load_suffix(spec: str, boundary: int, seed: int = 0, attention: str = DEFAULT_ATTENTION) -> Suffix:
    """The model `spec` (preset, save_pretrained directory or run directory) with only the suffix from
    `boundary` in memory, in the dtype of its weight files, running the `attention` implementation. A preset is
    built whole from its seed and then loses its prefix."""
    if spec in PRESETS:
        model = build_preset(spec, seed, attention)
        staged = preinfer.stage(model)
        digest = hash_tensors(named_prefix_tensors(staged, boundary))
        _keep_only(model, staged.suffix_modules(boundary))
        return Suffix(model, boundary, digest, None)
    model, files = _load_modules(spec, lambda staged: staged.suffix_modules(boundary), f"boundary {boundary}",
                                 attention)
    staged = preinfer.stage(model)
    return Suffix(model, boundary, _file_digest(staged, boundary, files, tensor_aliases(model)), files)


def load_modules(spec: str, modules_of: Callable[[preinfer.StagedModel], list[nn.Module]], what: str,
                 seed: int = 0, attention: str = DEFAULT_ATTENTION) -> nn.Module:
    """The model `spec` with only the tensors of `modules_of(staged model)` in memory (the rest on the meta
    device), read by name from its weight files; `what` names the part in errors. A preset is built whole from
    its seed (its initialisation draws every tensor in turn) and then loses the rest."""
    if spec in PRESETS:
        model = build_preset(spec, seed, attention)
        _keep_only(model, modules_of(preinfer.stage(model)))
        return model
    return _load_modules(spec, modules_of, what, attention)[0]


def _load_modules(spec: str, modules_of: Callable[[preinfer.StagedModel], list[nn.Module]],
                  what: str, attention: str, files: TensorFiles | None = None) -> tuple[nn.Module, TensorFiles]:
    """A model built on the meta device whose tensors used by `modules_of(staged)` are read from its files (or
    from `files`, which hold them by the same names)."""
    config, own = config_and_files(spec)
    files = files if files is not None else own
    with torch.device("meta"):
        model = cast_weights(AutoModelForCausalLM.from_config(config, attn_implementation=attention), files.dtype())
    staged = preinfer.stage(model)
    aliases = tensor_aliases(model)
    stored = {id(t) for _, t in persistent_tensors(model)}
    for tensor in _tensors_of(modules_of(staged)):
        if id(tensor) not in stored:
            continue  # derived from the config (rotary tables): rebuilt below
        name = files.find(aliases[id(tensor)])
        if name is None:
            raise UsageError(f"the weights of {spec} lack {aliases[id(tensor)][0]}, which {what} needs")
        _replace(model, tensor, files.get(name).to(tensor.dtype))
    staged.rebuild_shared_modules()
    return model, files


def load_from(spec: str, files: TensorFiles, attention: str = DEFAULT_ATTENTION) -> nn.Module:
    """The whole model `spec` (a save_pretrained directory) with every tensor taken from `files` by name."""
    return _load_modules(spec, lambda staged: [staged.model], "the model", attention, files)[0]


def to_device(model: nn.Module, device: str | torch.device, host: Collection[int] = ()) -> nn.Module:
    """Move the resident tensors (not the meta prefix, nor the tensors whose ids are in `host`: those stay where
    they are) to `device`, keeping tied weights tied."""
    moved: dict[int, torch.Tensor] = {}
    for module in model.modules():
        for registry in (module._parameters, module._buffers):
            for key, tensor in registry.items():
                if tensor is None or tensor.is_meta or id(tensor) in host:
                    continue
                if id(tensor) not in moved:
                    data = tensor.data.to(device)
                    is_param = isinstance(tensor, nn.Parameter)
                    moved[id(tensor)] = nn.Parameter(data, tensor.requires_grad) if is_param else data
                registry[key] = moved[id(tensor)]
    return model


def meta_model(spec: str, attention: str = DEFAULT_ATTENTION) -> nn.Module:
    """The model `spec` names built on the meta device (no storage), in its weight files' dtype: its shape
    without its weights."""
    if spec in PRESETS:
        config, dtype = preset_config(spec, attention), torch.float32
    else:
        config, files = config_and_files(spec)
        dtype = files.dtype()
    with torch.device("meta"):
        return cast_weights(AutoModelForCausalLM.from_config(config, attn_implementation=attention), dtype)


def prefix_digest(spec: str, boundary: int, seed: int = 0) -> Suffix:
    """The model `spec` on the meta device with the digest of its weights below `boundary` (None when its
    files lack them), tensor by tensor, as `load_suffix` computes it: what `check_prefix` compares with a store's.
    A preset is built whole from its seed for the digest."""
    if spec in PRESETS:
        digest = hash_tensors(named_prefix_tensors(preinfer.stage(build_preset(spec, seed)), boundary))
        return Suffix(meta_model(spec), boundary, digest, None)
    model = meta_model(spec)
    files = config_and_files(spec)[1]
    staged = preinfer.stage(model)
    staged.rebuild_shared_modules()
    return Suffix(model, boundary, _file_digest(staged, boundary, files, tensor_aliases(model)), files)


def config_and_files(spec: str) -> tuple[PreTrainedConfig, TensorFiles]:
    """The config of the model `spec` (a run directory: its base model's) and the files that hold its weights."""
    path = Path(spec)
    if is_run_dir(spec):
        run = RunDir(spec)
        run_config = load_config(run.config)
        base = run_config.model.name
        config = preset_config(base) if base in PRESETS else AutoConfig.from_pretrained(base, local_files_only=True)
        own = TensorFiles.of_directory(Path(base)).files if run_config.model.masters == "disk" else []
        return config, TensorFiles([*own, *run_files(run, run_config)])
    if not (path / "config.json").is_file():
        raise UsageError(f"--model '{spec}' is neither a preset ({', '.join(PRESETS)}), a run directory nor a "
                         f"save_pretrained directory")
    return AutoConfig.from_pretrained(path, local_files_only=True), TensorFiles.of_directory(path)


def _file_digest(staged, boundary: int, files: TensorFiles, aliases: dict[int, list[str]]) -> str | None:
    """The prefix digest from the files, tensor by tensor; None if any prefix tensor is missing."""
    missing = []

    def stream() -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in named_prefix_tensors(staged, boundary):
            if not tensor.is_meta:
                yield name, tensor
                continue
            source = files.find(aliases[id(tensor)])
            if source is None:
                missing.append(name)
                return
            yield name, files.get(source).to(tensor.dtype)

    digest = hash_tensors(stream())
    return None if missing else digest


def _tensors_of(modules: list[nn.Module]) -> list[torch.Tensor]:
    seen: dict[int, torch.Tensor] = {}
    for module in modules:
        for tensor in [*module.parameters(), *module.buffers()]:
            seen.setdefault(id(tensor), tensor)
    return list(seen.values())


def _keep_only(model: nn.Module, modules: list[nn.Module]) -> None:
    """Move every tensor of `model` that none of `modules` uses to the meta device."""
    needed = {id(t) for t in _tensors_of(modules)}
    _drop(model, [t for t in _tensors_of([model]) if id(t) not in needed])


def _drop(model: nn.Module, tensors: list[torch.Tensor]) -> None:
    for tensor in tensors:
        _replace(model, tensor, torch.empty_like(tensor, device="meta"))


def _replace(model: nn.Module, old: torch.Tensor, value: torch.Tensor) -> None:
    """Put `value` wherever `old` is registered (every alias of a tied weight, so the tie holds), as a frozen
    parameter or a buffer."""
    new = nn.Parameter(value, requires_grad=False) if isinstance(old, nn.Parameter) else value
    for module in model.modules():
        for registry in (module._parameters, module._buffers):
            for key, current in registry.items():
                if current is old:
                    registry[key] = new
