"""Faults injected into the caching job through its `before_shard_write` hook."""

import functools
from pathlib import Path

from pipelines.cache import CacheOptions
from pipelines.commands import cache as cache_command


def fail_shards(names: frozenset[str], split: str, shard: int) -> None:
    """A `before_shard_write` hook: the shards `names` ("train/3") fail on every attempt."""
    if f"{split}/{shard}" in names:
        raise RuntimeError(f"injected fault on shard {split}/{shard}")


def fail_once(marker_dir: str, names: frozenset[str], split: str, shard: int) -> None:
    """A `before_shard_write` hook: the shards `names` fail once (a marker file in `marker_dir` records it)."""
    if f"{split}/{shard}" in names:
        try:
            with open(Path(marker_dir) / f"fault-{split}-{shard}", "x"):
                pass
        except FileExistsError:
            return
        raise RuntimeError(f"injected fault on shard {split}/{shard}")


def cli_hook(monkeypatch, hook) -> None:
    """Make `preinfer cache` (run in this process) pass `hook` as its options' before_shard_write."""
    monkeypatch.setattr(cache_command, "CacheOptions", functools.partial(CacheOptions, before_shard_write=hook))
