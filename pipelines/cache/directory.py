"""A cache directory: one store per split in `<root>/<split>/` and an index `<root>/cache.json` written last."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

from preinfer.errors import UsageError
from storage import (
    STORE_ENTRIES, Fingerprint, Location, Store, StorageError, blobs_for, is_store, location, open_store,
)

CACHE_INDEX = "cache.json"
CACHE_FORMAT = "preinfer-cache"
DEFAULT_SPLITS = ("train", "eval")


def cache_splits(path: str | os.PathLike | Location) -> dict[str, Location]:
    """{split: store path} of a cache directory, or {"": path} for a single store; {} if neither (a local path or
    an fsspec URL)."""
    path = location(path)
    if is_store(path):
        return {"": path}
    if not path.is_dir():
        return {}
    names = sorted((p.name for p in path.iterdir() if is_store(p)),
                   key=lambda n: (DEFAULT_SPLITS.index(n) if n in DEFAULT_SPLITS else len(DEFAULT_SPLITS), n))
    return {name: path / name for name in names}


def listed_splits_missing(path: str | os.PathLike | Location, found: Mapping[str, Location]) -> dict[str, Location]:
    """{split: where its store should be} for the splits the cache index lists that `found` (`cache_splits`) lacks."""
    if "" in found:
        return {}
    root = location(path)
    listed = read_index(root).get("splits")
    if not isinstance(listed, dict):
        return {}
    return {split: root / str(entry.get("path", split) if isinstance(entry, dict) else split)
            for split, entry in listed.items() if split not in found}


def open_cache(path: str | os.PathLike | Location, splits: list[str] | None = None,
               expect: Mapping[str, Fingerprint] | None = None) -> dict[str, Store]:
    """The stores of a cache directory (or {"": store} for a single store), checked against `expect`; `splits`
    names the splits a cache directory must have."""
    found = cache_splits(path)
    if not found:
        raise StorageError(f"no activation store or cache directory at {path}")
    if splits is not None:
        if "" in found:
            raise UsageError(_not_a_root(location(path), splits))
        missing = [s for s in splits if s not in found]
        if missing:
            raise StorageError(f"cache {path} has no split {', '.join(missing)} (it has {', '.join(found)})")
        found = {s: found[s] for s in splits}
    return {name: open_store(p, expect_fingerprint=(expect or {}).get(name)) for name, p in found.items()}


def _not_a_root(store: Location, splits: list[str]) -> str:
    """Why a single store will not do where a cache directory with `splits` is needed, and what to pass."""
    if store.name in DEFAULT_SPLITS:
        return f"{store} is the {store.name} split of a cache: pass the cache root {store.parent}"
    return f"{store} is a single store: pass a cache root (made by `preinfer cache`) holding {', '.join(splits)}"


def holds_only_store_entries(directory: Location) -> bool:
    """Whether every entry of `directory` is one a store owns (a store, or what a killed writer left of one)."""
    return all(p.name in STORE_ENTRIES or p.name.startswith(".") for p in directory.iterdir())


def _is_ours(entry: Location, names: list[str]) -> bool:
    if entry.name == CACHE_INDEX:
        return entry.is_file()
    if entry.name not in set(names) | set(DEFAULT_SPLITS) or not entry.is_dir():
        return False
    return holds_only_store_entries(entry)


def check_out(out: Location, names: list[str], mode: str, flag: str = "--out") -> None:
    """Refuse an output directory (given by `flag`; not a file: see `pipelines.jobs.output.check_not_a_file`) holding something other
    than this cache."""
    if not out.is_dir():
        return
    if names == [""]:
        return  # a single store: create_store refuses a foreign directory itself
    foreign = sorted(p.name for p in out.iterdir() if not p.name.startswith(".") and not _is_ours(p, names))
    if foreign:
        raise UsageError(
            f"{flag} {out} is not a cache directory (it holds {foreign[0]!r}{' ...' if len(foreign) > 1 else ''}); "
            f"choose an empty or new directory, nothing was deleted"
        )
    if mode == "refuse" and any((out / n).exists() for n in names):
        raise UsageError(f"{flag} {out} already holds a cache; choose another directory or rebuild it")


def read_index(root: Location) -> dict[str, Any]:
    """The index of the cache directory `root`, {} if it has none (or an unreadable one)."""
    try:
        return json.loads(blobs_for(root).read(CACHE_INDEX))
    except (OSError, ValueError):
        return {}


def write_index(root: Location, payload: dict[str, Any]) -> None:
    """Publish the index of the cache directory `root` atomically (rename on a disk, one PUT on object storage)."""
    blobs_for(root).write(CACHE_INDEX, json.dumps(payload, indent=1).encode())
