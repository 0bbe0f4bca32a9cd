"""The token data of a live run (one process or a pipeline): its train and eval splits from the token store, and
the batches read from them."""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from preinfer.config import Config, DataConfig
from preinfer.errors import UsageError
from preinfer.batch_source import LiveSources
from pipelines.data import batches
from pipelines.data.token_store import TokenStoreDataset
from pipelines.data.corpus import CorpusDigest
from pipelines.data.token_store.resolve import data_splits, eval_samples
from pipelines.data.tokenizer_choice import announce, model_tokenizer
from pipelines.data.tokenizers import Tokenizer


@dataclass
class Datasets:
    train: TokenStoreDataset
    eval: TokenStoreDataset  # capped by --eval-tokens
    tokenizer: Tokenizer


def load_datasets(config: Config, quiet: bool = False, corpus: CorpusDigest | None = None) -> Datasets:
    """The run's splits, read lazily from the token store of --data (built first if need be: by rank 0 alone
    while the other ranks wait). --max-samples takes each split's first samples, --eval-tokens caps eval.
    `corpus`: the corpus's fingerprint where the run has it already (`pipelines.training.inputs.run_corpus`)."""
    m = config.model
    choice = model_tokenizer(m.tokenizer, m.name, m.chat_template, m.chat_template_name)
    tokenizer, d = choice.tokenizer, config.data

    first = not dist.is_initialized() or dist.get_rank() == 0
    if not first:
        dist.barrier()
    found = data_splits(d, tokenizer, ["train", "eval"], progress=not quiet, corpus=corpus)
    if first and dist.is_initialized():
        dist.barrier()
    announce(choice, found, quiet or not first)
    found = run_samples(found, d)
    check_batch_size(d.batch_size, len(found["train"]), f"the train split of {d.path}")
    return Datasets(found["train"], found["eval"], tokenizer)


def run_samples(splits: dict[str, TokenStoreDataset], d: DataConfig) -> dict[str, TokenStoreDataset]:
    """The samples a run reads of each split: --max-samples takes each split's first, --eval-tokens caps eval (what
    a run's stores hold, so `preinfer verify` recomputes the same samples)."""
    found = {name: split.head(d.max_samples) if d.max_samples else split for name, split in splits.items()}
    capped = eval_samples(d.eval_tokens, d.seq_len)
    if "eval" in found and capped is not None and capped < len(found["eval"]):
        found["eval"] = found["eval"].head(capped)
    return found


def check_batch_size(batch_size: int, samples: int, split: str) -> None:
    """Refuse a batch larger than the split it is drawn from."""
    if batch_size > samples:
        raise UsageError(f"--batch-size {batch_size} is more than the {samples} samples of {split}; give at most "
                         f"{samples}")


def live_sources(data: Datasets, config: Config, shard: int, rank: int = 0, world: int = 1) -> LiveSources:
    """The run's token batches (see `pipelines.data.batches.live_sources`)."""
    return batches.live_sources(data.train, data.eval, config.data.batch_size, shard, config.run.seed, rank, world)
