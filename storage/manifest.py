"""The store manifest (`manifest.json`): schema, fingerprint, field specs, and parsing with plain-word errors."""

from __future__ import annotations

import datetime
import importlib.metadata
import json
import re
from dataclasses import dataclass, field
from typing import Any

import torch

from storage.dtypes import dtype_name, numpy_dtype, torch_dtype
from storage.encodings import ENCODINGS, SCALE_SUFFIX, is_lossy
from storage.errors import CorruptStoreError, StaleStoreError, StorageError, UnsupportedFormatError

MANIFEST = "manifest.json"
FORMAT = "preinfer-activation-store"
FORMAT_VERSION = 1
# Store formats (the manifest's "backend" entry).
FORMATS = ("zarr", "safetensors", "memory")
_FIELD_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$")


@dataclass(frozen=True)
class Fingerprint:
    """What a store's content depends on: an opaque `digest` plus the readable `parts` it was made from."""

    digest: str
    parts: dict[str, str | int | float | bool] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        """The JSON form stored in the manifest."""
        return {"digest": self.digest, "parts": dict(self.parts)}

    @classmethod
    def coerce(cls, value: Any) -> Fingerprint:
        """A Fingerprint from a Fingerprint, a digest string, a {digest, parts} dict, or any object with both."""
        if isinstance(value, Fingerprint):
            return value
        if isinstance(value, str):
            return cls(value, {})
        if isinstance(value, dict) and "digest" in value:
            digest, parts = value["digest"], value.get("parts", {})
        elif hasattr(value, "digest"):
            digest, parts = value.digest, getattr(value, "parts", {})
        else:
            raise StorageError(f"a fingerprint must be a storage.Fingerprint, a digest string or a dict, not {value!r}")
        if not isinstance(digest, str) or not isinstance(parts, dict):
            raise StorageError(f"a fingerprint needs a string digest and a dict of parts, got {value!r}")
        for key, part in parts.items():
            if not isinstance(part, (str, int, float, bool)):
                raise StorageError(f"fingerprint part {key!r} must be a string or a number, not {type(part).__name__}")
        return cls(digest, dict(parts))

    def differences(self, other: Fingerprint) -> list[str]:
        """The readable parts that differ between this (stored) fingerprint and `other` (expected), in words."""
        diffs = [
            f"{key}: store has {self.parts.get(key, '<unset>')!r}, expected {other.parts.get(key, '<unset>')!r}"
            for key in sorted(set(self.parts) | set(other.parts))
            if self.parts.get(key) != other.parts.get(key)
        ]
        if not diffs and self.digest != other.digest:
            diffs.append(f"digest: store has {self.digest!r}, expected {other.digest!r} (readable parts are equal)")
        return diffs


@dataclass(frozen=True)
class FieldSpec:
    """One stored field: the shape of one sample and its dtype name."""

    shape: tuple[int, ...]
    dtype: str

    @property
    def sample_bytes(self) -> int:
        """Bytes of one sample of this field, uncompressed."""
        count = 1
        for dim in self.shape:
            count *= dim
        return count * numpy_dtype(self.dtype).itemsize

    @property
    def torch_dtype(self) -> torch.dtype:
        """The torch dtype of this field's tensors."""
        return torch_dtype(self.dtype)


def tool_version() -> str:
    """The version of the package that writes stores."""
    try:
        return importlib.metadata.version("preinfer")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def parse_fields(fields: dict[str, Any]) -> dict[str, FieldSpec]:
    """Validated field specs from `{name: (per_sample_shape, dtype)}`."""
    if not isinstance(fields, dict) or not fields:
        raise StorageError("fields must be a non-empty dict {name: (per_sample_shape, torch_dtype)}")
    specs = {}
    for name, spec in fields.items():
        if not isinstance(name, str) or not _FIELD_NAME.match(name):
            raise StorageError(f"field name {name!r} must be letters, digits, '_', '.' or '-' (it names files)")
        try:
            shape, dtype = spec
            shape = tuple(int(dim) for dim in shape)
        except (TypeError, ValueError):
            raise StorageError(f"field {name!r}: expected (per_sample_shape, dtype), got {spec!r}") from None
        if any(dim <= 0 for dim in shape):
            raise StorageError(f"field {name!r}: every dimension of the per-sample shape must be positive, got {shape}")
        specs[name] = FieldSpec(shape, dtype_name(dtype))
    return _with_scales(specs)


def _with_scales(specs: dict[str, FieldSpec]) -> dict[str, FieldSpec]:
    """The specs plus the float32 per-row scale field `<name>_scale` of each lossy field (which may be given
    already, as in a manifest, but with exactly that spec)."""
    out = dict(specs)
    for name, spec in specs.items():
        if not is_lossy(spec.dtype):
            continue
        if not spec.shape:
            raise StorageError(f"field {name!r}: a {spec.dtype} field needs at least one dimension per sample")
        scale = FieldSpec(spec.shape[:-1], "float32")
        if out.setdefault(name + SCALE_SUFFIX, scale) != scale:
            raise StorageError(f"field {name + SCALE_SUFFIX!r} is the scale of {spec.dtype} field {name!r}: it must "
                               f"have shape {list(scale.shape)} and dtype float32, or be left out")
    return out


def encodings_record(fields: dict[str, FieldSpec]) -> dict[str, dict[str, Any]]:
    """The manifest's record of each lossy field's encoding (what a reader of the raw arrays needs)."""
    return {
        name: {"codes": spec.dtype, "scale": name + SCALE_SUFFIX, "max_code": ENCODINGS[spec.dtype].max_code,
               "bound": ENCODINGS[spec.dtype].bound,
               "decode": f"{name} = {name} * {name + SCALE_SUFFIX}[..., None] (the scale is max|row| / max_code, "
                         f"rounded up); |error| <= bound * scale"}
        for name, spec in fields.items() if is_lossy(spec.dtype)
    }


def new_manifest(
    format: str, fields: dict[str, FieldSpec], num_samples: int, samples_per_shard: int,
    fingerprint: Fingerprint, codec: dict[str, Any],
) -> dict[str, Any]:
    """The manifest of a freshly created, still empty store (lossy fields add an "encodings" entry)."""
    encodings = encodings_record(fields)
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "tool": {"name": "preinfer", "version": tool_version()},
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "backend": format,
        "codec": codec,
        "num_samples": num_samples,
        "samples_per_shard": samples_per_shard,
        "num_shards": -(-num_samples // samples_per_shard),
        "fields": {name: {"shape": list(spec.shape), "dtype": spec.dtype} for name, spec in fields.items()},
        **({"encodings": encodings} if encodings else {}),
        "fingerprint": fingerprint.to_json(),
        "complete": False,
        "shards": {},
    }


def parse_manifest(raw: bytes, where: str) -> dict[str, Any]:
    """The manifest dict from the bytes of `manifest.json`, checked; `where` names the file in errors."""
    try:
        manifest = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CorruptStoreError(
            f"{where} is not valid JSON ({err}); the file is truncated or garbled. Rebuild the store "
            f"(create_store(..., overwrite=True)) or restore the file."
        ) from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CorruptStoreError(f"{where} is not a preinfer activation-store manifest (no \"format\": \"{FORMAT}\")")
    version = manifest.get("format_version")
    if version != FORMAT_VERSION:
        raise UnsupportedFormatError(
            f"{where} has store format version {version!r}, but this tool reads only version {FORMAT_VERSION} "
            f"(written by {manifest.get('tool', {}).get('name', '?')} {manifest.get('tool', {}).get('version', '?')}); "
            f"use a matching version of the tool or rebuild the store"
        )
    try:
        if manifest["backend"] not in FORMATS:
            raise UnsupportedFormatError(f"{where} names unknown format {manifest['backend']!r}; known: {FORMATS}")
        num_samples, per_shard = int(manifest["num_samples"]), int(manifest["samples_per_shard"])
        if num_samples <= 0 or per_shard <= 0 or manifest["num_shards"] != -(-num_samples // per_shard):
            raise _garbled(where, "inconsistent num_samples / samples_per_shard / num_shards")
        parse_fields({name: (spec["shape"], spec["dtype"]) for name, spec in manifest["fields"].items()})
        Fingerprint.coerce(manifest["fingerprint"])
        if not isinstance(manifest["shards"], dict) or not isinstance(manifest["codec"], dict):
            raise _garbled(where, "'shards' and 'codec' must be objects")
    except (UnsupportedFormatError, CorruptStoreError):
        raise
    except (KeyError, TypeError, ValueError, AttributeError, StorageError) as err:
        raise _garbled(where, f"{type(err).__name__}: {err}") from None
    return manifest


def _garbled(where: str, problem: str) -> CorruptStoreError:
    return CorruptStoreError(f"{where} is garbled: {problem}; rebuild the store")


def check_fingerprint(stored: Fingerprint, expected: Any, where: str) -> None:
    """Raise StaleStoreError naming the differing parts unless the stored fingerprint equals `expected`."""
    expected = Fingerprint.coerce(expected)
    if stored.digest == expected.digest:
        return
    diffs = stored.differences(expected)
    raise StaleStoreError(
        f"store {where} is stale: it was built for another fingerprint ({'; '.join(diffs)}). "
        f"Rebuild it (create_store(..., overwrite=True)) or point to the store made for this configuration."
    )
