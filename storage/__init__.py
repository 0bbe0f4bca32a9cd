"""Activation stores: sharded zarr v3 / safetensors / memory formats behind one small interface.

Everything other packages use is named here; the submodules are this package's own business."""

from storage.api import STORE_ENTRIES, create_store, is_store, open_store
from storage.blobs import Blobs, blobs_for
from storage.codecs import codec_spec
from storage.encodings import ENCODINGS, Encoding, bytes_per_token, is_lossy, merge_stats, nonfinite_rows
from storage.errors import (
    CorruptStoreError,
    IncompleteStoreError,
    LayoutMismatchError,
    StaleStoreError,
    StorageError,
    UnsupportedFormatError,
    UnsupportedLocationError,
)
from storage.locations import SCHEMES, Location, UrlPath, disk_bytes, free_bytes, location, remove_tree
from storage.owner import OWNER_ENTRIES, OutputBusyError, owning
from storage.manifest import FORMAT_VERSION, FORMATS, MANIFEST, FieldSpec, Fingerprint
from storage.reader import Reader
from storage.store import Store, format_ranges
from storage.verify import VerifyReport, verify

__all__ = [
    "create_store", "open_store", "is_store", "verify", "codec_spec", "Store", "Reader", "Fingerprint", "FieldSpec",
    "VerifyReport", "FORMAT_VERSION", "FORMATS", "MANIFEST", "STORE_ENTRIES", "StorageError", "StaleStoreError",
    "CorruptStoreError", "IncompleteStoreError", "LayoutMismatchError", "UnsupportedFormatError", "ENCODINGS",
    "Encoding", "bytes_per_token", "is_lossy", "merge_stats", "nonfinite_rows", "format_ranges",
    "UnsupportedLocationError", "location", "Location", "UrlPath", "SCHEMES", "remove_tree", "disk_bytes",
    "free_bytes", "Blobs", "blobs_for", "owning", "OutputBusyError", "OWNER_ENTRIES",
]
