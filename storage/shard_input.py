"""What a shard's writer hands the store: its tensors checked against the store's fields, its lossy fields encoded
(refusing values the encoding cannot hold, naming the samples), and shard or sample indices written as ranges."""

from __future__ import annotations

from typing import Protocol

import torch

from storage.dtypes import torch_dtype
from storage.encodings import SCALE_SUFFIX, Encoding, error_stats, nonfinite_rows
from storage.errors import StorageError
from storage.manifest import FieldSpec


class ShardLayout(Protocol):
    """What these checks read of a `storage.store.Store`."""

    path: str
    fields: dict[str, FieldSpec]
    encodings: dict[str, Encoding]

    @property
    def written_fields(self) -> list[str]: ...

    def shard_range(self, i: int) -> tuple[int, int]: ...


def format_ranges(indices: list[int], limit: int = 20) -> str:
    """Shard indices as compact ranges: '0-3, 7, 9-12'."""
    runs: list[list[int]] = []
    for i in sorted(indices):
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    text = [f"{a}" if a == b else f"{a}-{b}" for a, b in runs[:limit]]
    return ", ".join(text) + (f", ... ({len(runs) - limit} more runs)" if len(runs) > limit else "")


def checked_tensors(store: ShardLayout, i: int, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`tensors` as shard `i` of `store` takes them (its written fields, shapes and dtypes), detached on the CPU."""
    start, stop = store.shard_range(i)
    where = f"store {store.path}: write_shard({i}) (samples {start}..{stop})"
    if not isinstance(tensors, dict) or set(tensors) != set(store.written_fields):
        got = sorted(tensors) if isinstance(tensors, dict) else type(tensors).__name__
        raise StorageError(f"{where}: expected exactly the fields {sorted(store.written_fields)}, got {got}")
    checked = {}
    for name in store.written_fields:
        spec, tensor = store.fields[name], tensors[name]
        expected = (stop - start, *spec.shape)
        if not isinstance(tensor, torch.Tensor):
            raise StorageError(f"{where}: field {name!r} must be a torch.Tensor, not {type(tensor).__name__}")
        lossy = name in store.encodings
        dtype_ok = tensor.is_floating_point() if lossy else tensor.dtype == torch_dtype(spec.dtype)
        if tuple(tensor.shape) != expected or not dtype_ok:
            wanted = f"a floating dtype (encoded to {spec.dtype})" if lossy else f"dtype {spec.dtype}"
            raise StorageError(
                f"{where}: field {name!r} must have shape {list(expected)} and {wanted}, "
                f"got shape {list(tensor.shape)} and dtype {str(tensor.dtype).removeprefix('torch.')}"
            )
        checked[name] = tensor.detach().cpu().contiguous()
    return checked


def encoded(store: ShardLayout, i: int, tensors: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, dict]]:
    """The tensors with each lossy field encoded (codes and scale), and the decoding error of each; refuses
    non-finite values, naming the samples."""
    out, errors = dict(tensors), {}
    for name, encoding in store.encodings.items():
        x = tensors[name]
        _refuse_rows(store, i, name, nonfinite_rows(x), f"NaN or inf; a {encoding.name} store cannot hold them")
        codes, scale = encoding.encode(x)
        decoded = encoding.decode(codes, scale)
        # |x| within a rounding of float32's largest: q * s overflows
        _refuse_rows(store, i, name, nonfinite_rows(decoded), f"values too close to float32's largest; a "
                                                             f"{encoding.name} store cannot hold them")
        out[name], out[name + SCALE_SUFFIX] = codes, scale
        errors[name] = error_stats(x, decoded, scale, encoding.bound)
    return out, errors


def _refuse_rows(store: ShardLayout, i: int, name: str, rows: list[int], what: str) -> None:
    """Raise StorageError naming the samples of shard `i` at `rows` (indices in the shard), if any."""
    if rows:
        start, stop = store.shard_range(i)
        raise StorageError(f"store {store.path}: shard {i} (samples {start}..{stop}): field {name!r} holds {what} "
                           f"(samples {format_ranges([start + r for r in rows])})")
