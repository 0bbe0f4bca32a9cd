"""`preinfer verify`: every shard's integrity; with --model and data, samples recomputed and compared."""

from __future__ import annotations

import argparse

import preinfer
from preinfer.config import Config
from preinfer.errors import UsageError
from pipelines.data.tokenizer_choice import model_tokenizer
from pipelines.cache.directory import DEFAULT_SPLITS, cache_splits
from pipelines.cache.report import verify_cache
from pipelines.arguments import add_s3_endpoint, device, non_negative_int, store_location, use_s3_endpoint
from pipelines.data_arguments import add_data_arguments, data_splits
from pipelines.models import model_source
from storage import open_store


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("path", metavar="STORE", type=store_location,
                        help="a cache directory (all its splits) or a single store: a local path or s3://BUCKET/PATH")
    parser.add_argument("--model", help="recompute samples with this model (preset, directory or run directory)")
    add_data_arguments(parser)
    parser.add_argument("--sample", type=non_negative_int, default=8,
                        help="samples per store to recompute and compare, chosen at random [8]")
    parser.add_argument("--seed", type=int, default=0, help="seed of the sample choice [0]")
    parser.add_argument("--model-seed", type=int, help="initialisation seed of a preset [the run's, else 0]")
    parser.add_argument("--device", type=device, default="cpu", help="[cpu]")
    add_s3_endpoint(parser)


def run(args: argparse.Namespace) -> int:
    use_s3_endpoint(args)
    if (args.data or args.tokenizer) and not args.model:
        raise UsageError("--data and --tokenizer need --model (to recompute samples)")
    found = cache_splits(args.path)
    if not found:
        raise UsageError(f"no activation store or cache directory at {args.path}")
    staged = datasets = tokenizer = None
    if args.model:
        source, run_config = model_source(args.model, args.model_seed)
        base = run_config or Config()
        staged = preinfer.stage(source.load().to(args.device).eval())
        tokenizer = model_tokenizer(args.tokenizer or base.model.tokenizer, args.model,
                                    base.model.chat_template).tokenizer
        seq_len = int(open_store(next(iter(found.values())), check_files=False).fingerprint.parts.get(
            "seq_len", base.data.seq_len))
        names = [s for s in found if s] or list(DEFAULT_SPLITS)
        datasets = data_splits(args, base, tokenizer, seq_len, names, progress=False)
    checks = verify_cache(args.path, staged, datasets, tokenizer, samples=args.sample, seed=args.seed,
                          device=args.device)
    for check in checks:
        print(check)
    bad = [c.split or c.path for c in checks if not c.ok]
    print(f"verify: {'OK' if not bad else 'FAILED (' + ', '.join(bad) + ')'}")
    return 0 if not bad else 1
