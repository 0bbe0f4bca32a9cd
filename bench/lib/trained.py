"""A trained BCD run's model and data, and its stores in a store dtype (bench.stores' lossy sizes and bench.train's
store-dtype runs read them)."""

from __future__ import annotations

import pathlib


def trained_model(run_dir: str, seed: int = 0):
    """(staged model, the run's datasets) of a BCD run directory (its last checkpoint)."""
    import preinfer
    from pipelines.models import model_source
    from pipelines.training import load_datasets

    source, config = model_source(run_dir, seed)
    return preinfer.stage(source.load().eval()), load_datasets(config)


def cache_split(staged, data, boundary: int, out: pathlib.Path, store_dtype: str, codec: str = "blosc-zstd",
                source: pathlib.Path | None = None):
    """The train and eval stores at `boundary` in `store_dtype` (rolled forward from `source` when given)."""
    from pipelines.cache import CacheOptions, cache_boundary, roll_forward

    options = CacheOptions(store_dtype=store_dtype, codec=codec, mode="overwrite", progress=False,
                           samples_per_shard=64, model_name="trained")
    if source is not None:
        return roll_forward(staged, source, boundary, out, options)
    return cache_boundary(staged, {"train": data.train, "eval": data.eval}, data.tokenizer, boundary, out, options)
