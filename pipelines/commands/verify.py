"""`preinfer verify`: every shard's integrity; with --model and data, samples recomputed and compared."""

from __future__ import annotations

import argparse

import preinfer
from preinfer.config import Config, RunConfig
from preinfer.errors import UsageError
from pipelines.data.tokenizer_choice import model_tokenizer
from pipelines.cache.directory import DEFAULT_SPLITS, cache_splits
from pipelines.cache.report import verify_cache
from pipelines.data.run_data import run_samples
from pipelines.data.token_store.resolve import data_splits
from pipelines.flags import DATA_FLAGS, add_flags, data_flags, use_s3_endpoint
from pipelines.models import model_source
from storage import open_store


# The flags that choose which samples of the data a run's stores hold: a run's own, when --model is a run directory.
RUN_SAMPLES = ("--eval-tokens", "--max-samples")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_flags(parser, "path", "--model", *DATA_FLAGS, *RUN_SAMPLES, "--attention", "--sample", "--seed",
              "--model-seed", "--device", "--s3-endpoint", command="verify", defaults={"--device": RunConfig.device},
              from_run=(*DATA_FLAGS, *RUN_SAMPLES, "--model-seed", "--attention"))


def run(args: argparse.Namespace) -> int:
    use_s3_endpoint(args)
    if (args.data or args.tokenizer) and not args.model:
        raise UsageError("--data and --tokenizer need --model (to recompute samples)")
    found = cache_splits(args.path)
    if not found:
        raise UsageError(f"no activation store or cache directory at {args.path}")
    staged = datasets = tokenizer = None
    if args.model:
        parts = open_store(next(iter(found.values())), check_files=False).fingerprint.parts
        source, run_config = model_source(args.model, args.model_seed, args.attention or parts.get("attention"))
        base = run_config or Config()
        staged = preinfer.stage(source.load().to(args.device).eval())
        tokenizer = model_tokenizer(args.tokenizer or base.model.tokenizer, args.model,
                                    base.model.chat_template, base.model.chat_template_name).tokenizer
        data = data_flags(args, base)
        data.seq_len = int(parts.get("seq_len", data.seq_len))
        names = [s for s in found if s] or list(DEFAULT_SPLITS)
        datasets = run_samples(data_splits(data, tokenizer, names, progress=False), data)
    checks = verify_cache(args.path, staged, datasets, tokenizer, samples=args.sample, seed=args.seed,
                          device=args.device)
    for check in checks:
        print(check)
    bad = [c.split or c.path for c in checks if not c.ok]
    print(f"verify: {'OK' if not bad else 'FAILED (' + ', '.join(bad) + ')'}")
    return 0 if not bad else 1
