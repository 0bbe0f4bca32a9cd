"""The token store: a corpus tokenised once into sharded stores on disk (`tokenize_corpus`, `preinfer tokenize`)
and read lazily by sample index (`TokenStoreDataset`). Layout: `pipelines.data.token_store.layout`; the job:
`pipelines.data.token_store.job`."""

from pipelines.data.token_store.dataset import TokenStoreDataset, open_token_store
from pipelines.data.token_store.job import TokenizeResult, cache_path, token_fingerprint, tokenize_corpus
from pipelines.data.token_store.options import TokenizeOptions
from pipelines.data.token_store.layout import SplitInfo, TokenStoreInfo

__all__ = [
    "tokenize_corpus", "TokenizeOptions", "TokenizeResult", "token_fingerprint", "cache_path", "TokenStoreDataset",
    "open_token_store", "TokenStoreInfo", "SplitInfo",
]
