"""`preinfer cache`: run the frozen prefix once over a dataset and store the boundary states (see
`pipelines.cache`), from the input or rolled forward from a store at a lower boundary."""

from __future__ import annotations

import argparse
import json

import preinfer
from preinfer.config import Config, RunConfig
from preinfer.errors import UsageError
from pipelines.data.tokenizer_choice import model_tokenizer
from pipelines.cache import (
    DEFAULT_SPLITS, CacheJobError, CacheOptions, CacheResult, cache_boundary, check_boundary, roll_forward,
)
from pipelines.data.token_store.resolve import data_splits
from pipelines.flags import DATA_FLAGS, add_flags, data_flags, option_defaults, use_s3_endpoint
from pipelines.jobs.output import check_not_a_file, writing
from pipelines.models import model_source
from storage import location


DEFAULTS = CacheOptions()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = {**option_defaults(DEFAULTS), "--splits": ",".join(DEFAULT_SPLITS), "--device": RunConfig.device}
    add_flags(parser, "--model", "--boundary", "--out", *DATA_FLAGS, "--seq-len", "--splits", "--from-store",
              "--store-format", "--codec", "--store-dtype", "--batch-size", "--samples-per-shard", command="cache",
              defaults=defaults, from_run=(*DATA_FLAGS, "--seq-len"), required=("--model",),
              renamed={"--store-format": "--format", "--store-dtype": "--dtype"})
    add_flags(parser.add_mutually_exclusive_group(), "--workers", "--dask", command="cache")
    add_flags(parser, "--retries", command="cache", defaults=defaults)
    add_flags(parser.add_mutually_exclusive_group(), "--resume", "--overwrite", command="cache")
    add_flags(parser, "--attention", "--seed", "--device", "--quiet", "--json", "--s3-endpoint", defaults=defaults,
              from_run=("--attention", "--seed"))


def run(args: argparse.Namespace) -> int:
    use_s3_endpoint(args)
    out = location(args.out)
    check_not_a_file(out)
    splits = [s.strip() for s in args.splits.split(",") if s.strip()]
    unknown = [s for s in splits if s not in DEFAULT_SPLITS]
    if not splits or unknown:
        raise UsageError(f"--splits {args.splits!r}: choose from {', '.join(DEFAULT_SPLITS)}")
    dask = args.dask or (f"local:{args.workers}" if args.workers > 1 else None)
    source, run_config = model_source(args.model, args.seed, args.attention)
    base, seed = run_config or Config(), source.seed
    options = CacheOptions(
        store_format=args.store_format, store_dtype=args.store_dtype, batch_size=args.batch_size,
        samples_per_shard=args.samples_per_shard, codec=args.codec, mode="overwrite" if args.overwrite else "resume",
        model_name=args.model, model_seed=seed, progress=not args.quiet, dask=dask, retries=args.retries,
        device=args.device,
    )
    staged = preinfer.stage(source.load().to(args.device).eval())
    with writing(out, lambda err: CacheJobError(f"writing the cache in {out} failed: {err}")):
        if args.from_store:
            chosen = None if args.splits == ",".join(DEFAULT_SPLITS) else splits
            result = roll_forward(staged, args.from_store, args.boundary, out, options, splits=chosen)
        else:
            check_boundary(staged, args.boundary)
            tokenizer = model_tokenizer(args.tokenizer or base.model.tokenizer, args.model,
                                        base.model.chat_template, base.model.chat_template_name).tokenizer
            datasets = data_splits(data_flags(args, base), tokenizer, splits, not args.quiet)
            result = cache_boundary(staged, datasets, tokenizer, args.boundary, out, options)
    if args.json:
        print(json.dumps(result_json(result)))
    else:
        print(result.summary())
    return 0


def result_json(result: CacheResult) -> dict:
    return {
        "path": str(result.path), "boundary": result.boundary, "source_boundary": result.source_boundary,
        "samples": result.samples, "tokens": result.tokens, "bytes_written": result.bytes_written,
        "seconds": result.seconds, "tokens_per_s": result.tokens_per_s, "shards_computed": result.shards_computed,
        "shards_skipped": result.shards_skipped, "dtype": result.store_dtype, "format": result.store_format,
        "workers": result.workers, "model_loads": result.model_loads,
        "splits": {name: {"path": str(s.path), "samples": s.samples, "tokens": s.tokens, "shards": s.num_shards,
                          "computed": s.shards_computed, "skipped": s.shards_skipped,
                          "stored_bytes": s.stored_bytes, "fingerprint": s.fingerprint.digest}
                   for name, s in result.splits.items()},
    }
