"""`preinfer eval`: the loss and perplexity of a model on a dataset's eval split."""

from __future__ import annotations

import argparse
import json
import math

import torch

import preinfer
from preinfer.config import Config, RunConfig
from pipelines.data.tokenizer_choice import model_tokenizer
from preinfer.evaluation import evaluate
from pipelines.data.token_store.resolve import data_splits
from pipelines.flags import DATA_FLAGS, add_flags, data_flags
from pipelines.models import model_source
from pipelines.data.batches import token_batches


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_flags(parser, "--model", *DATA_FLAGS, "--seq-len", "--attention", "--batch-size", "--split", "--device",
              "--json", command="eval", defaults={"--batch-size": 16, "--device": RunConfig.device},
              from_run=(*DATA_FLAGS, "--seq-len", "--attention"), required=("--model",))


def run(args: argparse.Namespace) -> int:
    source, run_config = model_source(args.model, attention=args.attention)
    base = run_config or Config()
    data = data_flags(args, base)
    tokenizer = model_tokenizer(args.tokenizer or base.model.tokenizer, args.model,
                                base.model.chat_template, base.model.chat_template_name).tokenizer
    dataset = data_splits(data, tokenizer, [args.split], progress=not args.json)[args.split]
    staged = preinfer.stage(source.load().to(args.device))
    batches = token_batches(dataset, args.batch_size, samples_per_shard=dataset.store.samples_per_shard,
                            shuffle=False)
    loss = evaluate(staged, batches, torch.device(args.device))
    result = {"model": args.model, "data": data.path, "split": args.split, "samples": len(dataset),
              "tokens": dataset.num_tokens, "loss": loss, "ppl": math.exp(min(loss, 50.0))}
    if args.json:
        print(json.dumps(result))
    else:
        print(f"{args.model} on {data.path} ({args.split}, {len(dataset)} samples of {data.seq_len} tokens): "
              f"loss {loss:.4f}, perplexity {result['ppl']:.2f}")
    return 0
