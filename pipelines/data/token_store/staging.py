"""The tokenize job's work in progress, kept under OUT/staging/ until the token store is complete:

    plan.json            whose work this is: the token fingerprint and the settings that shape the work
    chunk-NNNNNN.npz     chunk N's encoded splits (`pipelines.data.samples.EncodedSplit` arrays)
    chunk-NNNNNN.json    chunk N's counts, written after its arrays: the chunk's completion record
    encoded.json         written once every chunk is staged: how many there are and the kind of data
    replacement/         the new store's splits while it replaces a complete one (`--overwrite`): packed here, then
                         swapped in, so that a job that fails before leaves the replaced store whole

Every file is published atomically (written beside, then renamed), so a job killed at any moment leaves complete
files or none; arrays are read back without pickle.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np

from preinfer.atomic_write import write_atomically
from preinfer.errors import PreinferError
from pipelines.data.token_store.layout import read_json, write_json
from pipelines.data.sample_blocks import EncodedSplit
from pipelines.data.samples import SPLITS

PLAN = "plan.json"
ENCODED = "encoded.json"
REPLACEMENT = "replacement"
# The names of the staged files, and of their temporaries while they are written.
STAGED = re.compile(r"\.?(plan\.json|encoded\.json|chunk-\d{6}\.(npz|json)|replacement)(\.tmp-.*)?")


class StagingError(PreinferError):
    """The staging directory lacks a chunk the job counts as staged (removed while the job ran)."""


class Staging:
    """The staging directory of one token store."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def holds_only_staging(self) -> bool:
        """Whether this is a staging directory: it exists and holds nothing but the files a tokenize job stages
        (a job killed while publishing its first file leaves only that file's temporary)."""
        if not self.root.is_dir():
            return False
        return all(STAGED.fullmatch(entry.name) for entry in self.root.iterdir())

    @property
    def replacement(self) -> Path:
        """Where the splits of a store replacing a complete one are packed before they are swapped in."""
        return self.root / REPLACEMENT

    def plan(self) -> dict[str, Any] | None:
        """The plan of the work staged here, None if there is none."""
        return read_json(self.root / PLAN)

    def start(self, plan: dict[str, Any]) -> None:
        """Begin (or go on with) the work of `plan`."""
        self.root.mkdir(parents=True, exist_ok=True)
        write_json(self.root / PLAN, plan)

    def _chunk(self, index: int, suffix: str) -> Path:
        return self.root / f"chunk-{index:06d}{suffix}"

    def is_staged(self, index: int) -> bool:
        """Whether chunk `index` is staged completely."""
        return self._chunk(index, ".json").is_file()

    def write_chunk(self, index: int, encoded: dict[str, EncodedSplit]) -> None:
        """Stage chunk `index`: its arrays, then its counts (the completion record)."""
        arrays: dict[str, np.ndarray] = {}
        for split, part in encoded.items():
            arrays[f"{split}.ids"] = part.ids
            if part.lengths is not None:
                arrays[f"{split}.lengths"] = part.lengths
            if part.label_mask is not None:
                arrays[f"{split}.label_mask"] = part.label_mask

        def save(file: Path) -> None:
            with file.open("wb") as stream:
                np.savez(stream, **arrays)

        write_atomically(self._chunk(index, ".npz"), save)
        counts = {split: {"units": len(part.ids), "documents": part.documents, "truncated": part.truncated,
                          "skipped": part.skipped} for split, part in encoded.items()}
        write_json(self._chunk(index, ".json"), counts)

    def counts(self, index: int) -> dict[str, dict[str, int]]:
        """{split: {"units": tokens of the LM stream or padded rows, "documents": n, "truncated": conversations cut,
        "skipped": conversations left out}} of staged chunk `index`."""
        counts = read_json(self._chunk(index, ".json"))
        if counts is None or set(counts) != set(SPLITS):
            raise StagingError(f"chunk {index} is not staged in {self.root}")
        return counts

    def read_split(self, index: int, split: str, count: dict[str, int]) -> EncodedSplit:
        """The encoded part of `split` in staged chunk `index`, whose counts (`counts(index)[split]`) are `count`."""
        with np.load(self._chunk(index, ".npz"), allow_pickle=False) as arrays:
            lengths, label_mask = (arrays[f"{split}.{name}"] if f"{split}.{name}" in arrays.files else None
                                   for name in ("lengths", "label_mask"))
            return EncodedSplit(arrays[f"{split}.ids"], lengths, count["documents"], label_mask,
                                count.get("truncated", 0), count.get("skipped", 0))

    def encoded(self) -> dict[str, Any] | None:
        """{"chunks": n, "kind": ...} once every chunk is staged, else None."""
        return read_json(self.root / ENCODED)

    def finish_encoding(self, chunks: int, kind: str) -> dict[str, Any]:
        """Record that all `chunks` chunks are staged."""
        record = {"chunks": chunks, "kind": kind}
        write_json(self.root / ENCODED, record)
        return record

    def remove(self) -> None:
        """Delete the staging directory (the token store is complete)."""
        shutil.rmtree(self.root, ignore_errors=True)
