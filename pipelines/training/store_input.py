"""A run that reads a cache's stores instead of running the prefix: its stores and boundary, the check that they
were made from the model's own prefix, their batches, and the tokenizer saved beside the export."""

from __future__ import annotations

from pathlib import Path

import storage

from preinfer.batch_source import LiveSources
from preinfer.config import Config
from pipelines.cache import open_cache
from pipelines.data.run_data import check_batch_size
from pipelines.data.batches import ReaderBatches
from pipelines.data.token_store.resolve import eval_samples
from pipelines.data.tokenizers import Tokenizer
from pipelines.models.suffix import Suffix


class StoreInput:
    """The train and eval stores of the cache at `store.path`."""

    def __init__(self, config: Config):
        self.stores = open_cache(config.store.path, splits=["train", "eval"])
        self.train, self.eval = self.stores["train"], self.stores["eval"]
        self.boundary = int(self.train.fingerprint.parts["boundary"])
        check_batch_size(config.data.batch_size, self.train.num_samples, f"the train store of {config.store.path}")

    def sources(self, config: Config, rank: int, world: int) -> LiveSources:
        """Shuffled train batches (this data-parallel rank's share) and the eval batches, in order, capped by
        --eval-tokens."""
        batch, seed = config.data.batch_size, config.run.seed
        limit = eval_samples(config.data.eval_tokens, self.eval.fields["labels"].shape[0])
        return LiveSources(ReaderBatches(self.train, self.boundary, batch, seed, rank, world),
                           ReaderBatches(self.eval, self.boundary, batch, seed, shuffle=False, limit=limit))

    def check_prefix(self, suffix: Suffix, config: Config) -> str:
        """Refuse stores made from other prefix weights than the model's (unless store.trust); says why they
        were accepted."""
        made_from = str(self.train.fingerprint.parts.get("prefix", ""))
        model, where = config.model.name, self.train.path
        if suffix.prefix_digest is None:
            return (f"{model} holds no weights below boundary {suffix.boundary}: the store {where} stands in for "
                    f"them on its own fingerprint")
        if suffix.prefix_digest == made_from:
            return f"store {where} matches {model}'s layers below boundary {suffix.boundary}"
        message = (f"store {where} was made from other weights than {model}'s layers below boundary "
                   f"{suffix.boundary} (prefix digest {made_from[:12]} in the store, {suffix.prefix_digest[:12]} in "
                   f"the model)")
        if not config.store.trust:
            raise storage.StaleStoreError(f"{message}; rebuild it with `preinfer cache`, or pass --trust-store")
        return f"{message}; used anyway (--trust-store)"

    def save_tokenizer(self, tokenizer: Tokenizer, directory: Path) -> None:
        """Save `tokenizer` beside an export trained from the stores if they were made with it; otherwise say in
        the export's README.md which tokenizer is missing."""
        made_with = str(self.train.fingerprint.parts.get("tokenizer", ""))
        if tokenizer.fingerprint() == made_with:
            tokenizer.save(directory)
            return
        (directory / "README.md").write_text(
            f"# No tokenizer saved\n\nThe store this model was trained from ({self.train.path}) was tokenised with "
            f"a tokenizer other than `{tokenizer.name}` (tokenizer fingerprint {made_with[:12]} in the store). Save "
            f"that tokenizer here (`tokenizer.save_pretrained(...)`) before loading this directory with "
            f"`AutoTokenizer` or `pipeline`, or train with `preinfer train --tokenizer DIR` naming it.\n")
