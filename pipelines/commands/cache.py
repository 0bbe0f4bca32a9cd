"""`preinfer cache`: run the frozen prefix once over a dataset and store the boundary states (see
`pipelines.cache`), from the input or rolled forward from a store at a lower boundary."""

from __future__ import annotations

import argparse
import json
import sys

import preinfer
from preinfer.config import Config
from preinfer.errors import UsageError
from pipelines.data.tokenizer_choice import model_tokenizer
from pipelines.cache import (
    DEFAULT_SPLITS, STORE_DTYPES, STORE_FORMATS, CacheJobError, CacheOptions, CacheResult, cache_boundary,
    check_boundary, roll_forward,
)
from pipelines.arguments import (
    add_s3_endpoint, device, non_negative_int, positive_int, store_location, use_s3_endpoint,
)
from pipelines.data_arguments import add_data_arguments, data_splits
from pipelines.models import model_source
from storage import location


DEFAULTS = CacheOptions()


class _Renamed(argparse.Action):
    """A flag with an old spelling that still works this version, with a note on stderr when it is used."""

    def __call__(self, parser, namespace, values, option_string=None):
        if option_string != self.option_strings[0]:
            print(f"preinfer cache: note: {option_string} is deprecated, use {self.option_strings[0]}",
                  file=sys.stderr)
        setattr(namespace, self.dest, values)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True,
                        help="a preset, a save_pretrained directory, or a BCD run directory (its current weights)")
    parser.add_argument("--boundary", type=int, required=True,
                        help="K in [1, layers]: store the input of layer K (embedding and layers [0, K) are run)")
    parser.add_argument("--out", required=True, type=store_location,
                        help="cache directory: one store per split in OUT/<split>/ and an index OUT/cache.json; "
                             "a local path or s3://BUCKET/PATH")
    add_data_arguments(parser)
    parser.add_argument("--seq-len", type=positive_int, help="tokens per sample [the run's, else 128]")
    parser.add_argument("--splits", default=",".join(DEFAULT_SPLITS),
                        help="comma-separated splits to cache [train,eval]")
    parser.add_argument("--from-store", metavar="STORE_K", type=store_location,
                        help="roll forward: run only layers [K, --boundary) over the cache (or store) at boundary K")
    parser.add_argument("--store-format", "--format", action=_Renamed, choices=STORE_FORMATS,
                        default=DEFAULTS.store_format,
                        help=f"store format (--format: the old spelling) [{DEFAULTS.store_format}]")
    parser.add_argument("--codec", help="zarr codec: blosc-zstd, blosc-lz4, zstd, none [blosc-zstd; none for "
                                        "safetensors]")
    parser.add_argument("--store-dtype", "--dtype", action=_Renamed, choices=["auto", *STORE_DTYPES],
                        default=DEFAULTS.store_dtype,
                        help="storage dtype of hidden states; auto = the compute dtype, bit-exact; float8_e4m3, "
                             "float8_e5m2, int8: lossy 8-bit codes with a per-token scale, decoding error measured "
                             f"per shard (--dtype: the old spelling) [{DEFAULTS.store_dtype}]")
    parser.add_argument("--batch-size", type=positive_int, default=DEFAULTS.batch_size,
                        help=f"forward batch [{DEFAULTS.batch_size}]")
    parser.add_argument("--samples-per-shard", type=positive_int,
                        help="samples per shard (the unit of writing, resuming and Dask tasks) [about 64 MiB of "
                             "hidden states per shard, at least 1]")
    workers = parser.add_mutually_exclusive_group()
    workers.add_argument("--workers", type=positive_int, default=1,
                         help="1: one process, writing overlapped with compute; N > 1 is --dask local:N [1]")
    workers.add_argument("--dask", help="local:N (a LocalCluster of N worker processes, one Dask thread and "
                                        "cores/N torch threads each) or tcp://HOST:PORT (an existing scheduler)")
    parser.add_argument("--retries", type=non_negative_int, default=DEFAULTS.retries,
                        help=f"times a failed shard is retried before the job gives up on it [{DEFAULTS.retries}]")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--resume", action="store_true",
                      help="compute only the shards missing from the store at --out (the default)")
    mode.add_argument("--overwrite", action="store_true",
                      help="replace a store with another fingerprint (or layout) at --out")
    parser.add_argument("--seed", type=int, help="initialisation seed of a preset [the run's, else 0]")
    parser.add_argument("--device", type=device, default="cpu",
                        help="cpu, cuda, cuda:1 ...; with --dask local:N and a bare cuda, worker i takes GPU i mod the "
                             "visible GPUs [cpu]")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    parser.add_argument("--json", action="store_true", help="print the result as JSON instead of a summary line")
    add_s3_endpoint(parser)


def run(args: argparse.Namespace) -> int:
    use_s3_endpoint(args)
    out = location(args.out)
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {out} is a file, not a directory")
    splits = [s.strip() for s in args.splits.split(",") if s.strip()]
    unknown = [s for s in splits if s not in DEFAULT_SPLITS]
    if not splits or unknown:
        raise UsageError(f"--splits {args.splits!r}: choose from {', '.join(DEFAULT_SPLITS)}")
    dask = args.dask or (f"local:{args.workers}" if args.workers > 1 else None)
    source, run_config = model_source(args.model, args.seed)
    base, seed = run_config or Config(), source.seed
    options = CacheOptions(
        store_format=args.store_format, store_dtype=args.store_dtype, batch_size=args.batch_size,
        samples_per_shard=args.samples_per_shard, codec=args.codec, mode="overwrite" if args.overwrite else "resume",
        model_name=args.model, model_seed=seed, progress=not args.quiet, dask=dask, retries=args.retries,
        device=args.device,
    )
    staged = preinfer.stage(source.load().to(args.device).eval())
    try:
        if args.from_store:
            chosen = None if args.splits == ",".join(DEFAULT_SPLITS) else splits
            result = roll_forward(staged, args.from_store, args.boundary, out, options, splits=chosen)
        else:
            check_boundary(staged, args.boundary)
            tokenizer = model_tokenizer(args.tokenizer or base.model.tokenizer, args.model,
                                        base.model.chat_template).tokenizer
            datasets = data_splits(args, base, tokenizer, args.seq_len or base.data.seq_len, splits, not args.quiet)
            result = cache_boundary(staged, datasets, tokenizer, args.boundary, out, options)
    except (PermissionError, NotADirectoryError, FileExistsError) as err:
        raise UsageError(f"--out {out}: {err.strerror or err} ({err.filename or out})") from None
    except OSError as err:  # a full disk or a failing device outside a shard write
        raise CacheJobError(f"writing the cache in {out} failed: {err}") from None
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
