"""Creating and opening stores: `create_store` and `open_store`; `is_store` and `STORE_ENTRIES` for callers that
manage directories of stores."""

from __future__ import annotations

import json
import os
from typing import Any

from storage.blobs import LOCKS, Blobs, MemoryBlobs, blobs_for
from storage.codecs import codec_spec
from storage.errors import CorruptStoreError, LayoutMismatchError, StaleStoreError, StorageError
from storage.locations import UrlPath, location
from storage.manifest import (
    FORMATS, MANIFEST, Fingerprint, check_fingerprint, new_manifest, parse_fields, parse_manifest,
)
from storage.memory_backend import MemoryStore
from storage.owner import OWNER_ENTRIES
from storage.safetensors_backend import INDEX, SafetensorsStore
from storage.shard_input import format_ranges
from storage.store import MARKERS, Store
from storage.zarr_backend import ZarrStore

_STORES: dict[str, type[Store]] = {"zarr": ZarrStore, "safetensors": SafetensorsStore, "memory": MemoryStore}
# The top-level entries of a store directory (a complete store, or one a killed writer left); create_store
# replaces only a directory holding nothing else.
STORE_ENTRIES = frozenset({MANIFEST, ZarrStore.data_prefix, SafetensorsStore.data_prefix, INDEX, MARKERS, LOCKS,
                           *OWNER_ENTRIES})
# The manifest entries that make up a store's layout, by the name LayoutMismatchError reports them under.
_LAYOUT = {"format": "backend", "codec": "codec", "num_samples": "num_samples",
           "samples_per_shard": "samples_per_shard", "fields": "fields"}
# Memory-backed stores of this process, by path, so that open_store finds them again.
_MEMORY_STORES: dict[str, MemoryBlobs] = {}


def _read_manifest(blobs: Blobs) -> dict[str, Any] | None:
    try:
        raw = blobs.read(MANIFEST)
    except FileNotFoundError:
        return None
    except OSError as err:
        raise StorageError(f"cannot read {blobs.location}/{MANIFEST}: {err}") from None
    return parse_manifest(raw, f"{blobs.location}/{MANIFEST}")


def is_store(path: str | os.PathLike | UrlPath) -> bool:
    """Whether the directory (or URL) `path` holds a store (its manifest)."""
    return (location(path) / MANIFEST).is_file()


def _layout_differences(stored: dict[str, Any], wanted: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    """{entry: (stored, wanted)} of the layout entries that differ; a field reports as "field NAME"."""
    differences = {name: (stored[key], wanted[key]) for name, key in _LAYOUT.items()
                   if key != "fields" and stored[key] != wanted[key]}
    for name in sorted(set(stored["fields"]) | set(wanted["fields"])):
        if stored["fields"].get(name) != wanted["fields"].get(name):
            differences[f"field {name}"] = (stored["fields"].get(name), wanted["fields"].get(name))
    return differences


def _check_same_store(where: str, stored: dict[str, Any], wanted: dict[str, Any]) -> None:
    """Refuse to reopen a store made for another fingerprint or with another layout."""
    remedy = "pass overwrite=True to replace it, or choose another path"
    old, new = Fingerprint.coerce(stored["fingerprint"]), Fingerprint.coerce(wanted["fingerprint"])
    if old.digest != new.digest:
        raise StaleStoreError(f"a different store exists {where}: it was built for another fingerprint "
                              f"({'; '.join(old.differences(new))}); {remedy}")
    differences = _layout_differences(stored, wanted)
    if differences:
        raise LayoutMismatchError(f"a different store exists {where}", differences, remedy)


def create_store(
    path: str | os.PathLike,
    fields: dict[str, tuple[tuple[int, ...], Any]],
    num_samples: int,
    samples_per_shard: int,
    fingerprint: Any,
    format: str = "zarr",
    codec: str | None = None,
    codec_level: int | None = None,
    overwrite: bool = False,
) -> Store:
    """Create an empty store, or reopen an identical one at `path` to resume it; `overwrite` replaces any other.
    A store already there with another fingerprint raises StaleStoreError, with another layout
    LayoutMismatchError."""
    if format not in FORMATS:
        raise StorageError(f"unknown backend {format!r}: format must be one of {', '.join(FORMATS)}")
    if int(num_samples) <= 0 or int(samples_per_shard) <= 0:
        raise StorageError(f"num_samples ({num_samples}) and samples_per_shard ({samples_per_shard}) must be positive")
    manifest = new_manifest(
        format, parse_fields(fields), int(num_samples), int(samples_per_shard),
        Fingerprint.coerce(fingerprint), codec_spec(format, codec, codec_level),
    )
    path = str(path)
    if format == "memory":
        if path in _MEMORY_STORES and not overwrite:
            _check_same_store(f"in memory as {path!r}", json.loads(_MEMORY_STORES[path].read(MANIFEST)), manifest)
            return open_store(path)
        blobs: Blobs = MemoryBlobs(path)
        _MEMORY_STORES[path] = blobs
    else:
        blobs = blobs_for(path)
        existing_manifest = None if overwrite else _existing_manifest(blobs)
        if existing_manifest is not None:
            _check_same_store(f"at {path}", existing_manifest, manifest)
            return open_store(path)
        foreign = [key for key in blobs.list("") if key.split("/")[0] not in STORE_ENTRIES]
        if foreign:
            raise StorageError(
                f"{path} is not empty and is not an activation store (it holds {foreign[0]!r} ...); "
                f"choose another path, nothing was deleted"
            )
        blobs.remove_all()
    store = _STORES[format](blobs, manifest, create=True)
    blobs.write(MANIFEST, json.dumps(manifest, indent=1).encode())
    return store


def _existing_manifest(blobs: Blobs) -> dict[str, Any] | None:
    """The manifest at `blobs`, None if there is none; refuses to replace a directory that is not a store."""
    try:
        return _read_manifest(blobs)
    except StorageError as err:
        raise StorageError(f"{err} (to replace it, pass overwrite=True)") from None


def open_store(path: str | os.PathLike, expect_fingerprint: Any = None, check_files: bool = True) -> Store:
    """Open an existing store; refuses a stale fingerprint, an unknown format, and missing or truncated files."""
    path = str(path)
    blobs: Blobs = _MEMORY_STORES[path] if path in _MEMORY_STORES else blobs_for(path)
    manifest = _read_manifest(blobs)
    if manifest is None:
        raise StorageError(f"no activation store at {path}: {MANIFEST} not found (create it with create_store)")
    if expect_fingerprint is not None:
        check_fingerprint(Fingerprint.coerce(manifest["fingerprint"]), expect_fingerprint, path)
    store = _STORES[manifest["backend"]](blobs, manifest)
    if check_files:
        damaged = store.damaged_shards()
        if damaged:
            details = "; ".join(f"shard {i}: {problem}" for i, problem in list(damaged.items())[:5])
            raise CorruptStoreError(
                f"store {path} has {len(damaged)} damaged shards ({format_ranges(list(damaged))}): {details}. "
                f"Run storage.verify({path!r}) for the full report, then rebuild the store"
            )
    return store
