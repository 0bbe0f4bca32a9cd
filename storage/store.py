"""The Store: one interface over every backend (manifest, completion records, checks, write/read/finalize).

While a store is written, each finished shard publishes a completion record (`done/shard-NNNNNN.json`) and local
writers hold lock files (`locks/`); `finalize()` folds the records into the manifest and then deletes both, so a
complete store holds its data files and its manifest only. A job killed before that leaves them behind, and its
rerun resumes from them.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from typing import Any

import torch

from storage.blobs import Blobs
from storage.checksums import crc32c_tensor
from storage.dtypes import torch_dtype
from storage.encodings import ENCODINGS, SCALE_SUFFIX, Encoding, merge_stats
from storage.errors import CorruptStoreError, IncompleteStoreError, StorageError
from storage.manifest import MANIFEST, FieldSpec, Fingerprint
from storage.reader import Reader
from storage.shard_input import checked_tensors, encoded, format_ranges

MARKERS = "done"


class Store(ABC):
    """A sharded activation store: fixed fields, `num_samples` samples in shards of `samples_per_shard`.

    A backend subclasses it, names its `format`, and provides `_write_data` and `_read_data`; `_create_layout`,
    `_open_layout` and `_finalize_layout` are for a backend with a data layout of its own (no-ops here)."""

    format = ""
    data_prefix: str | None = None
    # Whether read_shard re-checksums decoded data (backends whose whole files carry a checksum need not).
    check_decoded = True

    def __init__(self, blobs: Blobs, manifest: dict[str, Any], create: bool = False) -> None:
        self._blobs = blobs
        self._manifest = manifest
        self.path = blobs.location
        self.fields = {name: FieldSpec(tuple(s["shape"]), s["dtype"]) for name, s in manifest["fields"].items()}
        self._records: dict[int, dict] = {int(i): rec for i, rec in manifest["shards"].items()}
        # lossy fields: {name: encoding}; each has a float32 scale field `<name>_scale` beside it
        self.encodings: dict[str, Encoding] = {
            name: ENCODINGS[spec.dtype] for name, spec in self.fields.items() if spec.dtype in ENCODINGS
        }
        if create:
            self._create_layout()
        self._open_layout()

    # ---- description -------------------------------------------------------------------------------------------
    @property
    def manifest(self) -> dict[str, Any]:
        """The manifest as last written (a copy); completion records fold into it at finalize()."""
        return json.loads(json.dumps(self._manifest))

    @property
    def num_samples(self) -> int:
        """Number of samples in the store."""
        return self._manifest["num_samples"]

    @property
    def samples_per_shard(self) -> int:
        """Samples per shard (the last shard may hold fewer)."""
        return self._manifest["samples_per_shard"]

    @property
    def num_shards(self) -> int:
        """Number of shards."""
        return self._manifest["num_shards"]

    @property
    def fingerprint(self) -> Fingerprint:
        """The fingerprint the store was built for."""
        return Fingerprint.coerce(self._manifest["fingerprint"])

    @property
    def codec(self) -> dict[str, Any]:
        """The codec record (name, level, ...)."""
        return dict(self._manifest["codec"])

    def shard_range(self, i: int) -> tuple[int, int]:
        """The sample range [start, stop) of shard `i`."""
        if not isinstance(i, int) or not 0 <= i < self.num_shards:
            raise StorageError(f"store {self.path}: shard index {i!r} out of range; it has shards 0..{self.num_shards - 1}")
        start = i * self.samples_per_shard
        return start, min(start + self.samples_per_shard, self.num_samples)

    def __repr__(self) -> str:
        return (
            f"<{type(self).__name__} {self.path!r}: {self.num_samples} samples in {self.num_shards} shards, "
            f"fields {', '.join(f'{n}{list(s.shape)}:{s.dtype}' for n, s in self.fields.items())}>"
        )

    # ---- completion records ------------------------------------------------------------------------------------
    @staticmethod
    def _marker(i: int) -> str:
        return f"{MARKERS}/shard-{i:06d}.json"

    def _record(self, i: int) -> dict | None:
        """The completion record of shard `i` (from the manifest or its marker), or None if not complete."""
        if i not in self._records:
            try:
                record = json.loads(self._blobs.read(self._marker(i)))
            except (FileNotFoundError, ValueError):
                return None
            self._records[i] = record
        return self._records[i]

    def _adopt_finalized(self) -> None:
        """Take the shard records of the manifest on disk if another writer has finalized this very store since
        (its completion records are gone then); read after the markers, so that one of the two has every record."""
        try:
            published = json.loads(self._blobs.read(MANIFEST))
        except (OSError, ValueError):
            return
        layout = [k for k in self._manifest if k not in ("shards", "complete")]
        if published.get("complete") and all(published.get(k) == self._manifest[k] for k in layout):
            self._records.update({int(i): rec for i, rec in published["shards"].items()})

    def completed_shards(self) -> list[int]:
        """Indices of the shards that are complete (looking at markers other writers published since)."""
        for key in self._blobs.list(MARKERS + "/"):
            name = key.rsplit("/", 1)[-1]
            if name.startswith("shard-") and name.endswith(".json"):
                self._record(int(name[6:-5]))
        if len(self._records) < self.num_shards:
            self._adopt_finalized()
        return sorted(i for i in self._records if 0 <= i < self.num_shards)

    def missing_shards(self) -> list[int]:
        """Indices of the shards not yet written completely: what a resuming job has left to do."""
        done = set(self.completed_shards())
        return [i for i in range(self.num_shards) if i not in done]

    @property
    def is_complete(self) -> bool:
        """Whether every shard is written."""
        return not self.missing_shards()

    def require_complete(self) -> None:
        """Raise IncompleteStoreError listing the missing shards unless every shard is written."""
        missing = self.missing_shards()
        if missing:
            raise IncompleteStoreError(
                f"store {self.path} is incomplete: {len(missing)} of {self.num_shards} shards are not written "
                f"(shards {format_ranges(missing)}); resume the caching job to write them, then finalize()"
            )

    # ---- writing -----------------------------------------------------------------------------------------------
    @property
    def written_fields(self) -> list[str]:
        """The fields a writer passes to write_shard: every field but the scales of lossy ones."""
        scales = {name + SCALE_SUFFIX for name in self.encodings}
        return [name for name in self.fields if name not in scales]

    def write_shard(self, i: int, tensors: dict[str, torch.Tensor]) -> None:
        """Write shard `i` whole and publish it atomically; rewriting identical content is a no-op. A lossy field
        is given in any floating dtype and encoded here; its decoding error goes into the completion record."""
        tensors, errors = encoded(self, i, checked_tensors(self, i, tensors))
        start, stop = self.shard_range(i)
        fields = {name: {"crc32c": crc32c_tensor(t), "bytes": t.nbytes} for name, t in tensors.items()}
        with self._blobs.lock(f"shard-{i:06d}"):
            existing = self._record(i)
            if existing is None:
                self._adopt_finalized()
                existing = self._records.get(i)
            if existing is not None:
                if existing["fields"] == fields:
                    return
                raise StorageError(
                    f"store {self.path}: shard {i} (samples {start}..{stop}) is already complete with different "
                    f"content; a store is written once per fingerprint (rebuild it with overwrite=True)"
                )
            try:
                files = self._write_data(i, tensors)
            except Exception as err:  # disk full, permissions, a vanished directory: the shard stays incomplete
                raise StorageError(
                    f"store {self.path}: writing shard {i} (samples {start}..{stop}) failed ({type(err).__name__}: "
                    f"{err}); the shard is not marked complete, fix the cause and write it again"
                ) from err
            record = {"shard": i, "samples": [start, stop], "fields": fields, "files": files}
            if errors:
                record["encoding_error"] = errors
            self._blobs.write(self._marker(i), json.dumps(record).encode())
            self._records[i] = record

    def finalize(self) -> None:
        """Check that every shard is complete, fold the completion records into the manifest, then delete the
        records and lock files (the manifest is published first: a crash in between leaves only extra files)."""
        self.require_complete()
        self._manifest["shards"] = {str(i): self._records[i] for i in range(self.num_shards)}
        self._manifest["complete"] = True
        self._finalize_layout()
        self._blobs.write(MANIFEST, json.dumps(self._manifest, indent=1).encode())
        self._blobs.remove(MARKERS)
        self._blobs.clear_locks()

    # ---- reading -----------------------------------------------------------------------------------------------
    def _corrupt(self, i: int, problem: str, field: str | None = None) -> CorruptStoreError:
        start, stop = self.shard_range(i)
        what = f"field {field!r} of " if field else ""
        return CorruptStoreError(
            f"store {self.path}: {what}shard {i} (samples {start}..{stop}) is corrupt: {problem}. "
            f"Run storage.verify({self.path!r}) for a full report; rebuild the store or rewrite the shard."
        )

    def file_problem(self, i: int, listing: dict[str, int] | None = None) -> str | None:
        """What is wrong with the files of complete shard `i` (missing, wrong size), or None."""
        for key, info in self._record(i)["files"].items():
            size = self._blobs.size(key) if listing is None else listing.get(key)
            if size is None:
                return f"file {key} is missing"
            if size != info["size"]:
                return f"file {key} has {size} bytes, expected {info['size']} (truncated or overwritten)"
        return None

    def damaged_shards(self) -> dict[int, str]:
        """Complete shards whose files are missing or have the wrong size, with the problem in words."""
        listing = self._blobs.list(self.data_prefix + "/") if self.data_prefix else None
        problems = {i: self.file_problem(i, listing) for i in self.completed_shards()}
        return {i: p for i, p in problems.items() if p}

    def read_shard(self, i: int, fields: list[str] | None = None, check: bool = True) -> dict[str, torch.Tensor]:
        """The tensors of complete shard `i` in their stored dtype; `check` compares the checksums taken at write."""
        start, stop = self.shard_range(i)
        record = self._record(i)
        if record is None:
            raise IncompleteStoreError(
                f"store {self.path}: shard {i} (samples {start}..{stop}) is not written yet; resume the caching job"
            )
        names = list(self.fields) if fields is None else list(fields)
        unknown = [n for n in names if n not in self.fields]
        if unknown:
            raise StorageError(f"store {self.path}: unknown fields {unknown}; it holds {sorted(self.fields)}")
        problem = self.file_problem(i)
        if problem:
            raise self._corrupt(i, problem)
        try:
            data = self._read_data(i, names)
        except StorageError:
            raise
        except Exception as err:  # any decoder failure (zarr, numcodecs, safetensors) means damaged bytes
            raise self._corrupt(i, f"cannot decode it ({type(err).__name__}: {err})") from None
        for name in names:
            spec, tensor = self.fields[name], data[name]
            if tuple(tensor.shape) != (stop - start, *spec.shape) or tensor.dtype != torch_dtype(spec.dtype):
                raise self._corrupt(i, f"decoded shape {list(tensor.shape)} / {tensor.dtype}", name)
            if check and self.check_decoded and crc32c_tensor(tensor) != record["fields"][name]["crc32c"]:
                raise self._corrupt(i, "checksum of the decoded data differs from the one recorded at write", name)
        return data

    def decode(self, tensors: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """`tensors` read from this store with every lossy field decoded into `dtype` (its scale field dropped);
        exact fields pass unchanged."""
        out = dict(tensors)
        for name, encoding in self.encodings.items():
            if name in out:
                out[name] = encoding.decode(out[name], out.pop(name + SCALE_SUFFIX), dtype)
        return out

    def shard_encoding_error(self, i: int) -> dict[str, dict[str, float]]:
        """The decoding error recorded for each lossy field of shard `i` ({} for an exact store or a shard not
        written yet; see storage.encodings.error_stats)."""
        record = self._record(i)
        return dict(record.get("encoding_error", {})) if record else {}

    def encoding_error(self) -> dict[str, dict[str, float]]:
        """The decoding error of each lossy field over the complete shards."""
        per_shard = [self.shard_encoding_error(i) for i in self.completed_shards()]
        return {name: merge_stats([errors[name] for errors in per_shard if name in errors]) for name in self.encodings}

    def will_read(self, i: int) -> None:
        """Hint that complete shard `i` is read soon, so that the OS reads its files ahead (cold reads)."""
        record = self._record(i)
        for key in record["files"] if record else ():
            self._blobs.will_need(key)

    def reader(self, batch_size: int, seed: int = 0, rank: int = 0, world_size: int = 1, **options: Any) -> Reader:
        """A shuffling, resumable, prefetching batch reader over the whole store (see storage.reader.Reader)."""
        return Reader(self, batch_size, seed=seed, rank=rank, world_size=world_size, **options)

    def shard_bytes(self, i: int) -> int:
        """Bytes on disk of the files of shard `i` (0 while it is not complete)."""
        record = self._record(i)
        return sum(f["size"] for f in record["files"].values()) if record else 0

    def size_info(self) -> dict[str, Any]:
        """Raw and stored bytes of the complete shards and the compression ratio, for `inspect`."""
        records = [self._records[i] for i in self.completed_shards()]
        raw = sum(f["bytes"] for rec in records for f in rec["fields"].values())
        stored = sum(f["size"] for rec in records for f in rec["files"].values())
        return {
            "raw_bytes": raw, "stored_bytes": stored, "ratio": raw / stored if stored else None,
            "complete_shards": len(records), "num_shards": self.num_shards,
        }

    # ---- backend hooks -----------------------------------------------------------------------------------------
    @abstractmethod
    def _write_data(self, i: int, tensors: dict[str, torch.Tensor]) -> dict[str, dict]:
        """Write the data of shard `i` durably; return {file key: {"size": bytes, ...}}."""

    @abstractmethod
    def _read_data(self, i: int, names: list[str]) -> dict[str, torch.Tensor]:
        """Decode the named fields of shard `i`."""

    def _create_layout(self) -> None:
        """Create the backend's empty data layout (before the manifest is written)."""

    def _open_layout(self) -> None:
        """Open the backend's data layout."""

    def _finalize_layout(self) -> None:
        """Backend work at finalize (e.g. an index file)."""
