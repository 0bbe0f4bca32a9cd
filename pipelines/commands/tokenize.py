"""`preinfer tokenize`: tokenise a corpus once into a token store on disk (see `pipelines.data.token_store`)."""

from __future__ import annotations

import argparse
import json

from pipelines.flags import add_flags, option_defaults
from pipelines.data.token_store import TokenizeOptions, tokenize_corpus

DEFAULTS = TokenizeOptions()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_flags(parser, "--data", "--dataset-split", "--tokenizer", "--chat-template", "--chat-template-name",
              "--skip-unrenderable", "--seq-len", "--eval-fraction", "--text-column", "--out", "--workers",
              "--samples-per-shard", "--overwrite", "--quiet", "--json", command="tokenize",
              defaults=option_defaults(DEFAULTS))


def run(args: argparse.Namespace) -> int:
    options = TokenizeOptions(
        data=args.data, tokenizer=args.tokenizer, chat_template=args.chat_template,
        chat_template_name=args.chat_template_name, dataset_split=args.dataset_split,
        skip_unrenderable=bool(args.skip_unrenderable), seq_len=args.seq_len, eval_fraction=args.eval_fraction,
        out=args.out, text_column=args.text_column, workers=args.workers, samples_per_shard=args.samples_per_shard,
        overwrite=args.overwrite, progress=not args.quiet,
    )
    result = tokenize_corpus(options)
    if args.json:
        print(json.dumps(result.to_json(), indent=1))
        return 0
    info = result.info
    splits = ", ".join(f"{name} {split.samples:,} samples ({split.tokens:,} tokens{_skipped(split.skipped)})"
                       for name, split in info.splits.items())
    if result.reused:
        print(f"{result.out}: token store up to date ({splits}); fingerprint {info.digest[:16]}")
    else:
        print(f"{result.out}: {splits} of {info.seq_len} {info.id_dtype} ids, {info.kind}, in {result.seconds:.1f} s "
              f"({result.chunks_encoded} chunks tokenised, {result.shards_written} shards written); fingerprint "
              f"{info.digest[:16]}")
    return 0


def _skipped(count: int) -> str:
    """The conversations --skip-unrenderable left out of a split, in words (nothing when none)."""
    return f"; {count:,} conversations skipped: the chat template cannot render them" if count else ""
