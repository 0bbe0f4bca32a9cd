"""What a token store holds and how it is laid out on disk.

    OUT/token-store.json   the description (`TokenStoreInfo`), written last: a token store is complete when it exists
    OUT/train/, OUT/eval/  one `storage` store per split that has samples (zarr), in corpus order
    OUT/staging/           the interrupted job's work (see `pipelines.data.token_store.staging`), gone once complete

Fields of a split's store, per sample:
- `ids`: the sample's token ids [seq_len] in the smallest dtype of the vocabulary (uint8, uint16 or int32, see
  `pipelines.data.samples.id_dtype`).
- `lengths` (instruction and chat data): [prompt length, length] int32. Labels are the ids on [prompt length,
  length) and -100 elsewhere; the mask is true on [0, length).
- `label_mask` (chat data only): [seq_len] uint8, the assistant mask: labels are further -100 where it is 0.
LM text stores ids only: its mask is all true and its labels equal its ids.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

import storage
from preinfer.atomic_write import write_atomically
from preinfer.errors import UsageError

INFO = "token-store.json"
STAGING = "staging"
FORMAT = "preinfer-token-store"
FORMAT_VERSION = 2  # 1 packed the ids' bytes into int32 words
SHARD_BYTES = 4 << 20  # stored `ids` bytes per shard by default (the unit of writing, resuming and reading)
KINDS = ("lm", "instruction", "chat")


@dataclass(frozen=True)
class SplitInfo:
    """One split: its samples and where they came from; `problem` says why a split has no samples."""

    samples: int
    tokens: int  # real (unpadded) tokens in its samples
    documents: int  # documents (or instruction examples, dropped ones included)
    problem: str | None = None
    truncated: int = 0  # conversations cut at a turn boundary to fit seq_len
    skipped: int = 0  # conversations the chat template cannot render, left out (--skip-unrenderable)


@dataclass(frozen=True)
class TokenStoreInfo:
    """The description of a complete token store (`token-store.json`)."""

    fingerprint: dict[str, Any]  # {"digest": sha256 hex, "parts": readable parts}
    kind: str  # "lm", "instruction" or "chat"
    seq_len: int
    id_dtype: str
    vocab_size: int
    pad_id: int
    eos_id: int
    samples_per_shard: int
    splits: dict[str, SplitInfo]

    @property
    def digest(self) -> str:
        """The fingerprint's digest."""
        return self.fingerprint["digest"]

    @property
    def store_fingerprint(self) -> storage.Fingerprint:
        """The fingerprint the split stores were created with (and are opened against)."""
        return storage.Fingerprint.coerce(self.fingerprint)

    def to_json(self) -> dict[str, Any]:
        """The JSON form written to `token-store.json`."""
        return {"format": FORMAT, "format_version": FORMAT_VERSION, **asdict(self)}


def store_fields(kind: str, seq_len: int, dtype: np.dtype) -> dict[str, tuple[tuple[int, ...], str]]:
    """The fields of a split's store."""
    fields = {"ids": ((seq_len,), dtype.name)}
    if kind != "lm":
        fields["lengths"] = ((2,), "int32")
    if kind == "chat":
        fields["label_mask"] = ((seq_len,), "uint8")
    return fields


def default_samples_per_shard(seq_len: int, dtype: np.dtype) -> int:
    """Samples per shard for about SHARD_BYTES of ids."""
    return max(1, SHARD_BYTES // (seq_len * dtype.itemsize))


def write_json(path: Path, record: dict[str, Any]) -> None:
    """Publish `record` as JSON at `path` atomically (a reader sees the old file or the whole new one)."""
    write_atomically(path, json.dumps(record, indent=1, sort_keys=True))


# What to do about a damaged token store, in every command that reads one (only `tokenize` has --overwrite).
REBUILD = "rebuild the token store with `preinfer tokenize --overwrite` (or delete it)"


def read_json(path: Path) -> dict[str, Any] | None:
    """The JSON object at `path`, None if there is no file; a garbled file is refused in one line."""
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        problem = f"{type(error).__name__}: {error}"
        raise UsageError(f"{path}: unreadable ({problem}); {REBUILD}") from None
    if not isinstance(record, dict):
        raise UsageError(f"{path}: expected a JSON object; {REBUILD}")
    return record


def read_info(root: Path) -> TokenStoreInfo | None:
    """The description of the complete token store at `root`, None if there is none (absent or unfinished)."""
    record = read_json(root / INFO)
    if record is None:
        return None
    where = root / INFO
    if record.get("format") != FORMAT or record.get("format_version") != FORMAT_VERSION:
        raise UsageError(
            f"{where}: not a token store of format {FORMAT} version {FORMAT_VERSION} (found "
            f"{record.get('format')!r} version {record.get('format_version')!r}); {REBUILD}"
        )
    try:
        fields = {key: record[key] for key in TokenStoreInfo.__dataclass_fields__}
        fields["splits"] = {name: SplitInfo(**split) for name, split in fields["splits"].items()}
        info = TokenStoreInfo(**fields)
    except (KeyError, TypeError, AttributeError) as error:
        raise UsageError(f"{where}: garbled ({type(error).__name__}: {error}); {REBUILD}") from None
    if info.kind not in KINDS:
        raise UsageError(f"{where}: unknown kind {info.kind!r}; expected one of {', '.join(KINDS)}")
    return info
