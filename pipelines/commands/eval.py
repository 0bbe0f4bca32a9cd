"""`preinfer eval`: the loss and perplexity of a model on a dataset's eval split."""

from __future__ import annotations

import argparse
import json
import math

import torch

import preinfer
from preinfer.config import Config, DataConfig, RunConfig
from pipelines.data.tokenizer_choice import model_tokenizer
from preinfer.trainer import evaluate
from pipelines.arguments import device, positive_int, run_or
from pipelines.data_arguments import add_data_arguments, data_splits
from pipelines.models import model_source
from pipelines.data.batches import token_batches


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="a run directory, a save_pretrained directory or a preset")
    add_data_arguments(parser)
    parser.add_argument("--seq-len", type=positive_int, help=f"tokens per sample {run_or(DataConfig.seq_len)}")
    parser.add_argument("--batch-size", type=positive_int, default=16, help="samples per forward batch")
    parser.add_argument("--split", choices=["eval", "train"], default="eval", help="the split to evaluate")
    parser.add_argument("--device", type=device, default=RunConfig.device, help="cpu, cuda, cuda:1 ...")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")


def run(args: argparse.Namespace) -> int:
    source, run_config = model_source(args.model)
    base = run_config or Config()
    data_path = args.data or base.data.path
    seq_len = args.seq_len or base.data.seq_len
    tokenizer = model_tokenizer(args.tokenizer or base.model.tokenizer, args.model,
                                    base.model.chat_template).tokenizer
    dataset = data_splits(args, base, tokenizer, seq_len, [args.split], progress=not args.json)[args.split]
    staged = preinfer.stage(source.load().to(args.device))
    batches = token_batches(dataset, args.batch_size, samples_per_shard=dataset.store.samples_per_shard,
                            shuffle=False)
    loss = evaluate(staged, batches, torch.device(args.device))
    result = {"model": args.model, "data": data_path, "split": args.split, "samples": len(dataset),
              "tokens": dataset.num_tokens, "loss": loss, "ppl": math.exp(min(loss, 50.0))}
    if args.json:
        print(json.dumps(result))
    else:
        print(f"{args.model} on {data_path} ({args.split}, {len(dataset)} samples of {seq_len} tokens): "
              f"loss {loss:.4f}, perplexity {result['ppl']:.2f}")
    return 0
