"""`preinfer tokenize`: tokenise a corpus once into a token store on disk (see `pipelines.data.token_store`)."""

from __future__ import annotations

import argparse
import json

from pipelines.flags import positive_int
from pipelines.data.token_store import TokenizeOptions, tokenize_corpus

DEFAULTS = TokenizeOptions()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--data", default=DEFAULTS.data,
                        help="a .txt, .jsonl (either also .gz or .zst) or .parquet file, a directory or a quoted glob "
                             f"pattern of them, or builtin:pydoc [{DEFAULTS.data}]")
    parser.add_argument("--tokenizer", default=DEFAULTS.tokenizer,
                        help=f"'byte' (built-in) or a local HF tokenizer directory [{DEFAULTS.tokenizer}]")
    parser.add_argument("--chat-template", help="a file whose Jinja chat template renders chat and instruction data "
                                                "instead of the tokenizer's own [the tokenizer's]")
    parser.add_argument("--seq-len", type=positive_int, default=DEFAULTS.seq_len,
                        help=f"tokens per sample [{DEFAULTS.seq_len}]")
    parser.add_argument("--eval-fraction", type=float, default=DEFAULTS.eval_fraction,
                        help=f"share of documents held out [{DEFAULTS.eval_fraction}]")
    parser.add_argument("--text-column", default=DEFAULTS.text_column,
                        help=f"the field (.jsonl) or column (.parquet) that holds LM text [{DEFAULTS.text_column}]")
    parser.add_argument("--out", required=True,
                        help="the token store's directory: OUT/train/ and OUT/eval/ (zarr stores) and "
                             "OUT/token-store.json")
    parser.add_argument("--workers", type=positive_int, default=DEFAULTS.workers,
                        help=f"processes that tokenise; the store is the same for any number [{DEFAULTS.workers}]")
    parser.add_argument("--samples-per-shard", type=positive_int,
                        help="samples per shard (the unit of writing, resuming and reading) [about 4 MiB of ids]")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace a token store of another corpus or setting at --out (a resumable, unfinished "
                             "one too); without it, an interrupted run of the same command resumes")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    parser.add_argument("--json", action="store_true", help="print the result as JSON instead of a summary line")


def run(args: argparse.Namespace) -> int:
    options = TokenizeOptions(
        data=args.data, tokenizer=args.tokenizer, chat_template=args.chat_template, seq_len=args.seq_len,
        eval_fraction=args.eval_fraction,
        out=args.out, text_column=args.text_column, workers=args.workers, samples_per_shard=args.samples_per_shard,
        overwrite=args.overwrite, progress=not args.quiet,
    )
    result = tokenize_corpus(options)
    if args.json:
        print(json.dumps(result.to_json(), indent=1))
        return 0
    info = result.info
    splits = ", ".join(
        f"{name} {split.samples:,} samples ({split.tokens:,} tokens)" for name, split in info.splits.items()
    )
    if result.reused:
        print(f"{result.out}: token store up to date ({splits}); fingerprint {info.digest[:16]}")
    else:
        print(f"{result.out}: {splits} of {info.seq_len} {info.id_dtype} ids, {info.kind}, in {result.seconds:.1f} s "
              f"({result.chunks_encoded} chunks tokenised, {result.shards_written} shards written); fingerprint "
              f"{info.digest[:16]}")
    return 0
