"""Creating and opening stores: `create_store` and `open_store`."""

from __future__ import annotations

import json
import os
from typing import Any

from storage.blobs import Blobs, MemoryBlobs, blobs_for
from storage.codecs import codec_spec
from storage.errors import CorruptStoreError, StorageError
from storage.manifest import BACKENDS, Fingerprint, check_fingerprint, new_manifest, parse_fields, parse_manifest
from storage.memory_backend import MemoryStore
from storage.safetensors_backend import SafetensorsStore
from storage.store import MANIFEST, Store, format_ranges
from storage.zarr_backend import ZarrStore

_BACKENDS: dict[str, type[Store]] = {"zarr": ZarrStore, "safetensors": SafetensorsStore, "memory": MemoryStore}
# Top-level directories a store owns; create_store removes only these (and the manifest).
_OWN_DIRS = ("data", "shards", "done", "locks", "shards.safetensors.index.json")
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


def _same_layout(a: dict[str, Any], b: dict[str, Any]) -> bool:
    keys = ("backend", "codec", "num_samples", "samples_per_shard", "fields")
    return all(a[k] == b[k] for k in keys) and a["fingerprint"]["digest"] == b["fingerprint"]["digest"]


def create_store(
    path: str | os.PathLike,
    fields: dict[str, tuple[tuple[int, ...], Any]],
    num_samples: int,
    samples_per_shard: int,
    fingerprint: Any,
    backend: str = "zarr",
    codec: str | None = None,
    codec_level: int | None = None,
    overwrite: bool = False,
) -> Store:
    """Create an empty store, or reopen an identical one at `path` to resume it; `overwrite` replaces any other."""
    if backend not in BACKENDS:
        raise StorageError(f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    if int(num_samples) <= 0 or int(samples_per_shard) <= 0:
        raise StorageError(f"num_samples ({num_samples}) and samples_per_shard ({samples_per_shard}) must be positive")
    manifest = new_manifest(
        backend, parse_fields(fields), int(num_samples), int(samples_per_shard),
        Fingerprint.coerce(fingerprint), codec_spec(backend, codec, codec_level),
    )
    path = str(path)
    if backend == "memory":
        if path in _MEMORY_STORES and not overwrite:
            existing = _MEMORY_STORES[path]
            if _same_layout(json.loads(existing.read(MANIFEST)), manifest):
                return open_store(path)
            raise StorageError(f"a different memory store named {path!r} exists; pass overwrite=True to replace it")
        blobs: Blobs = MemoryBlobs(path)
        _MEMORY_STORES[path] = blobs
    else:
        blobs = blobs_for(path)
        existing_manifest = None if overwrite else _existing_manifest(blobs)
        if existing_manifest is not None:
            if _same_layout(existing_manifest, manifest):
                return open_store(path)
            raise StorageError(
                f"a different store exists at {path} (another fingerprint, backend, codec or layout); pass "
                f"overwrite=True to replace it, or choose another path"
            )
        foreign = [key for key in blobs.list("") if key != MANIFEST and key.split("/")[0] not in _OWN_DIRS]
        if foreign:
            raise StorageError(
                f"{path} is not empty and is not an activation store (it holds {foreign[0]!r} ...); "
                f"choose another path, nothing was deleted"
            )
        blobs.remove_all()
    store = _BACKENDS[backend](blobs, manifest, create=True)
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
    store = _BACKENDS[manifest["backend"]](blobs, manifest)
    if check_files:
        damaged = store.damaged_shards()
        if damaged:
            details = "; ".join(f"shard {i}: {problem}" for i, problem in list(damaged.items())[:5])
            raise CorruptStoreError(
                f"store {path} has {len(damaged)} damaged shards ({format_ranges(list(damaged))}): {details}. "
                f"Run storage.verify({path!r}) for the full report; to rewrite them, delete their completion "
                f"records (done/shard-NNNNNN.json) and resume the caching job, or rebuild the store"
            )
    return store
