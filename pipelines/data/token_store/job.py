"""The tokenize job: a corpus tokenised once into a token store (see `pipelines.data.token_store.layout`).

1. Fingerprint: the sha256 of the corpus's content (`pipelines.data.corpus.corpus_fingerprint`), the tokenizer's
   fingerprint (its chat template included), seq_len, eval_fraction, the text column, the dataset split read and
   whether unrenderable conversations are skipped. Not the corpus's path or file times: a copied corpus
   keeps its token store, and an edited one never reuses a stale one.
2. Encode (`pipelines.data.token_store.encoding`): the document stream is cut into chunks of about `chunk_chars`
   characters (the same chunks whatever the number of workers); each chunk is split into train and eval, tokenised
   by one of `workers` processes, and staged.
3. Pack (`pipelines.data.token_store.packing`): one process reads the staged chunks in order, cuts each split into
   samples exactly as `pipelines.data.samples` does, and writes them shard by shard into the split's store
   (storage's atomic shard publish), then finalizes it.
4. Describe: `token-store.json` is written, then the staging directory removed.

Memory holds a few chunks of text and their ids (about `chunk_chars` each, per worker) and one shard, whatever the
corpus's size. A job killed at any moment and run again with the same arguments resumes: staged chunks are not
tokenised again, written shards not written again, and the bytes are those of an uninterrupted run.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import storage
from pipelines.data.corpus import CorpusDigest, corpus_fingerprint
from pipelines.data.corpus_files import DEFAULT_SPLIT
from pipelines.data.samples import SPLITS, id_dtype
from pipelines.data.token_store.encoding import encode_chunks
from pipelines.data.token_store.layout import (
    FORMAT_VERSION, INFO, STAGING, TokenStoreInfo, default_samples_per_shard, read_info, write_json,
)
from pipelines.data.token_store.options import TokenizeOptions
from pipelines.data.token_store.packing import Packing
from pipelines.data.token_store.staging import Staging
from pipelines.data.tokenizers import Tokenizer
from pipelines.jobs.errors import stopped
from pipelines.jobs.output import held_output
from preinfer.errors import PreinferError, UsageError

_OWN_ENTRIES = (INFO, STAGING, *SPLITS)  # what --overwrite may remove from --out


@dataclass(frozen=True)
class TokenizeResult:
    """What a tokenize job found or did."""

    out: Path
    info: TokenStoreInfo
    reused: bool  # the store was already complete: nothing was done
    chunks_encoded: int  # chunks this run tokenised (others were staged by an interrupted run)
    shards_written: int  # shards this run wrote
    seconds: float

    def to_json(self) -> dict[str, Any]:
        """A JSON summary."""
        return {
            "out": str(self.out), "fingerprint": self.info.digest, "reused": self.reused,
            "chunks_encoded": self.chunks_encoded, "shards_written": self.shards_written,
            "seconds": round(self.seconds, 3), "kind": self.info.kind, "seq_len": self.info.seq_len,
            "id_dtype": self.info.id_dtype, "splits": {name: asdict(split) for name, split in self.info.splits.items()},
        }


def token_fingerprint(
    data: str, tokenizer: Tokenizer, seq_len: int, eval_fraction: float, text_column: str = "text",
    dataset_split: str = DEFAULT_SPLIT, skip_unrenderable: bool = False, corpus: CorpusDigest | None = None,
) -> storage.Fingerprint:
    """The fingerprint of the token store of `data` tokenised by `tokenizer` (see the module docstring); the
    corpus's spelling and the tokenizer's name are readable parts only. `corpus`: the corpus's fingerprint where
    the caller has it already (`corpus_fingerprint(data, text_column, dataset_split)`), so it is read once."""
    corpus_digest, corpus_parts = corpus or corpus_fingerprint(data, text_column, dataset_split)
    content = {
        "format_version": FORMAT_VERSION, "corpus_digest": corpus_digest, "tokenizer_digest": tokenizer.fingerprint(),
        "seq_len": seq_len, "eval_fraction": eval_fraction, "text_column": text_column,
        "dataset_split": dataset_split, "skip_unrenderable": skip_unrenderable,
    }
    digest = hashlib.sha256(json.dumps(content, sort_keys=True).encode()).hexdigest()
    parts = {**content, "tokenizer": tokenizer.name, **corpus_parts}
    return storage.Fingerprint(digest, parts)


def cache_path(root: str | Path, fingerprint: storage.Fingerprint) -> Path:
    """Where a cache of token stores under `root` keeps the one of `fingerprint`."""
    return Path(root) / fingerprint.digest[:20]


def options_fingerprint(options: TokenizeOptions, tokenizer: Tokenizer, corpus: CorpusDigest | None = None
                        ) -> storage.Fingerprint:
    """The fingerprint of the token store `options` describe (`token_fingerprint`)."""
    return token_fingerprint(options.data, tokenizer, options.seq_len, options.eval_fraction, options.text_column,
                             options.dataset_split, options.skip_unrenderable, corpus)


def tokenize_corpus(options: TokenizeOptions, fingerprint: storage.Fingerprint | None = None) -> TokenizeResult:
    """Build (or resume, or find complete) the token store of `options` at `options.out`; `fingerprint`: its
    fingerprint where the caller has computed it (`options_fingerprint`), so the corpus is not read for it again."""
    started = time.perf_counter()
    options.check()
    tokenizer = options.load_tokenizer()
    fingerprint = fingerprint or options_fingerprint(options, tokenizer)
    out = Path(options.out)
    with held_output(out, "--out"):  # held for the whole job; a new --out that gets nothing goes again
        found = _prepare(out, fingerprint, options.overwrite)
        if found is not None:
            Staging(out / STAGING).remove()  # what a job killed after describing the store left
            return TokenizeResult(out, found, True, 0, 0, time.perf_counter() - started)
        try:
            return _build(options, tokenizer, fingerprint, out, started)
        except OSError as err:
            raise _stopped(out, err) from None


def _stopped(out: Path, err: OSError) -> PreinferError:
    """The one line of a job a full disk (or a failing one) stopped: where, why, and that the same command
    resumes it (what is staged and written stays)."""
    return stopped(f"writing the token store in {out} failed", err,
                   "run the same command again: it resumes from the chunks and shards already written")


def _build(
    options: TokenizeOptions, tokenizer: Tokenizer, fingerprint: storage.Fingerprint, out: Path, started: float
) -> TokenizeResult:
    """Encode (what is not staged yet), pack, describe. A complete store being replaced (--overwrite) stays whole
    until the new one is packed beside it (`Staging.replacement`), then the new splits are swapped in: a job that
    fails before (bad input, a full disk) leaves it as it was, and the same command finishes a cut swap."""
    dtype = id_dtype(tokenizer.vocab_size)
    per_shard = options.samples_per_shard or default_samples_per_shard(options.seq_len, dtype)
    staging = Staging(out / STAGING)
    plan = {"fingerprint": fingerprint.to_json(), "chunk_chars": options.chunk_chars, "samples_per_shard": per_shard}
    resumed = _check_plan(staging, plan, out, options.overwrite)
    replacing = (out / INFO).exists() or staging.replacement.exists()  # a complete store is there (--overwrite)
    swapped = replacing and not (out / INFO).exists()  # a swap that was cut: the splits it moved are in place
    staging.start(plan)
    try:
        encoded, chunks_encoded = staging.encoded(), 0
        if encoded is None:
            chunks_encoded = encode_chunks(options, staging, tokenizer)
            encoded = staging.encoded()
        packing = Packing(options, fingerprint, staging, encoded, dtype, per_shard)
        if packing.has_samples() and not resumed and not replacing:  # an unfinished store of another setting
            _remove_own(out, keep=STAGING)
        splits = {split: packing.pack(_packed_at(out, staging, split, replacing, swapped), split) for split in SPLITS}
        if not any(split.samples for split in splits.values()):
            raise UsageError(splits["train"].problem)
    except UsageError:  # bad input: it must change before a run can succeed, so nothing staged for it is of use
        staging.remove()
        raise
    if replacing:
        _swap_in(out, staging, {split: info.samples > 0 for split, info in splits.items()})
    info = TokenStoreInfo(
        fingerprint=fingerprint.to_json(), kind=encoded["kind"], seq_len=options.seq_len, id_dtype=dtype.name,
        vocab_size=tokenizer.vocab_size, pad_id=tokenizer.pad_id, eos_id=tokenizer.eos_id,
        samples_per_shard=per_shard, splits=splits,
    )
    write_json(out / INFO, info.to_json())
    staging.remove()
    return TokenizeResult(out, info, False, chunks_encoded, packing.shards_written, time.perf_counter() - started)


def _packed_at(out: Path, staging: Staging, split: str, replacing: bool, swapped: bool) -> Path:
    """Where `split` is packed: in --out; beside the complete store it replaces; in --out where a cut swap moved
    it already."""
    if not replacing or (swapped and not (staging.replacement / split).exists()):
        return out / split
    return staging.replacement / split


def _swap_in(out: Path, staging: Staging, has_store: dict[str, bool]) -> None:
    """The replacement's splits in place of the replaced store's: its description goes first (it is no longer
    complete), then each split is swapped by a rename (a split of no samples has no store: the old one goes)."""
    (out / INFO).unlink(missing_ok=True)
    for split, stored in has_store.items():
        new = staging.replacement / split
        if new.exists() or not stored:
            shutil.rmtree(out / split, ignore_errors=True)
        if new.exists():
            new.rename(out / split)


# ---- what --out holds ----


def _prepare(out: Path, fingerprint: storage.Fingerprint, overwrite: bool) -> TokenStoreInfo | None:
    """The complete token store of `fingerprint` at `out` if there is one (unless `overwrite`); otherwise check that
    the job may write there (refusing another token store without `overwrite`, and anything else at all)."""
    info = None if overwrite else read_info(out)
    if info is not None:
        if info.digest == fingerprint.digest:
            return info
        raise UsageError(
            f"--out {out} holds the token store of another corpus or setting "
            f"({_differences(info.store_fingerprint, fingerprint)}); pass --overwrite to replace it, or choose "
            f"another --out"
        )
    if out.is_dir():
        ours = (out / INFO).exists() or Staging(out / STAGING).holds_only_staging()
        strangers = sorted(name for name in (entry.name for entry in out.iterdir())
                           if name not in storage.OWNER_ENTRIES and not (ours and _own(name)))
        if strangers:
            raise UsageError(
                f"--out {out} is not empty and is not a token store (it holds {strangers[0]!r} ...); choose another "
                f"directory, nothing was deleted"
            )
    out.mkdir(parents=True, exist_ok=True)
    return None


def _remove_own(out: Path, keep: str = "") -> None:
    """Delete the token store's own entries of `out` but `keep` (nothing else)."""
    for name in _OWN_ENTRIES:
        target = out / name
        if name == keep:
            continue
        if target.is_dir():
            shutil.rmtree(target)
        elif target.exists():
            target.unlink()


def _own(name: str) -> bool:
    """Whether an entry of --out is the token store's own (or a temporary file of an interrupted write)."""
    return name in _OWN_ENTRIES or any(name.startswith(f".{own}.tmp-") for own in _OWN_ENTRIES)


def _check_plan(staging: Staging, plan: dict[str, Any], out: Path, overwrite: bool) -> bool:
    """Whether `staging` holds this plan's work (to go on with). The work of another fingerprint or setting is
    dropped with `overwrite`, else refused."""
    staged = staging.plan()
    if staged == plan:
        return True
    if staged is None or overwrite:
        staging.remove()
        return False
    what = "; ".join(
        f"{key}: {staged.get(key)!r} then, {plan[key]!r} now" for key in ("chunk_chars", "samples_per_shard")
        if staged.get(key) != plan[key]
    )
    if staged.get("fingerprint") != plan["fingerprint"]:
        stored, wanted = (storage.Fingerprint.coerce(record["fingerprint"]) for record in (staged, plan))
        what = _differences(stored, wanted)
    raise UsageError(
        f"--out {out} holds an unfinished token store of another corpus or setting ({what}); run the same command "
        f"again to finish it, or pass --overwrite to start over"
    )


def _differences(stored: storage.Fingerprint, expected: storage.Fingerprint) -> str:
    return "; ".join(stored.differences(expected)) or "another fingerprint"
