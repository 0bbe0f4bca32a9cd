"""The token store: a corpus tokenised once into sharded stores on disk (`tokenize_corpus`, `preinfer tokenize`)
and read lazily by sample index (`TokenStoreDataset`). Layout: `pipelines.tokenize.layout`; the job:
`pipelines.tokenize.job`."""

from pipelines.tokenize.dataset import TokenStoreDataset, open_token_store
from pipelines.tokenize.job import TokenizeOptions, TokenizeResult, cache_path, token_fingerprint, tokenize_corpus
from pipelines.tokenize.layout import SplitInfo, TokenStoreInfo

__all__ = [
    "tokenize_corpus", "TokenizeOptions", "TokenizeResult", "token_fingerprint", "cache_path", "TokenStoreDataset",
    "open_token_store", "TokenStoreInfo", "SplitInfo",
]
