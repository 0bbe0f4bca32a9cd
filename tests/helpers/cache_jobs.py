"""The caching job as the tests run it: its sizes, datasets, a staged model, one call, and store comparisons."""

from pathlib import Path

import torch

import preinfer
from pipelines.cache import CacheOptions, cache_boundary
from pipelines.data.in_memory import TokenDataset, load_data
from pipelines.data.token_store import TokenStoreDataset
from pipelines.data.token_store.resolve import token_splits
from pipelines.data.tokenizers import load_tokenizer
from preinfer.presets import build_preset
from storage import open_store

SEQ = 32
PER_SHARD = 16
BATCH = 6  # does not divide PER_SHARD: each shard ends with a short batch


def datasets_for(corpus: str, seq_len: int = SEQ) -> dict[str, TokenDataset]:
    tokenizer = load_tokenizer("byte")
    return {split: load_data(corpus, tokenizer, seq_len, split, 0.1) for split in ("train", "eval")}


def stored_datasets(corpus: str) -> dict[str, TokenStoreDataset]:
    """The splits as the CLI reads them: from the corpus's token store."""
    return token_splits(corpus, load_tokenizer("byte"), SEQ, 0.1, ["train", "eval"], progress=False)


def staged_model(name: str = "tiny-llama", seed: int = 0):
    return preinfer.stage(build_preset(name, seed).eval())


def cache(staged, datasets, boundary, out, **options):
    options = {"samples_per_shard": PER_SHARD, "batch_size": BATCH, "progress": False, "model_name": "tiny-llama",
               **options}
    return cache_boundary(staged, datasets, load_tokenizer("byte"), boundary, out, CacheOptions(**options))


def store_tensors(path) -> list[dict[str, torch.Tensor]]:
    store = open_store(path)
    return [store.read_shard(i) for i in range(store.num_shards)]


def assert_same_store(a, b) -> None:
    """Same fingerprint, layout, completion records (checksums) and bit-identical tensors."""
    sa, sb = open_store(a), open_store(b)
    assert sa.fingerprint == sb.fingerprint
    ma, mb = sa.manifest, sb.manifest
    for key in ("backend", "codec", "num_samples", "samples_per_shard", "fields", "complete"):
        assert ma[key] == mb[key], key
    assert {i: r["fields"] for i, r in ma["shards"].items()} == {i: r["fields"] for i, r in mb["shards"].items()}
    for x, y in zip(store_tensors(a), store_tensors(b)):
        assert x.keys() == y.keys()
        for name in x:
            assert x[name].dtype == y[name].dtype and torch.equal(x[name].view(-1).view(torch.uint8)
                                                                   if x[name].dtype == torch.bool else x[name],
                                                                   y[name].view(-1).view(torch.uint8)
                                                                   if y[name].dtype == torch.bool else y[name]), name


def assert_same_cache(a: Path, b: Path, splits=("train", "eval")) -> None:
    for split in splits:
        assert_same_store(a / split, b / split)
