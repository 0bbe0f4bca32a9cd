"""Activation stores: sharded zarr v3 / safetensors / memory formats behind one small interface.

Everything other packages use is named here, and nothing else (tests/test_import_graph.py checks both ways); the
submodules are this package's own business."""

from storage.api import STORE_ENTRIES, create_store, is_store, open_store
from storage.blobs import blobs_for
from storage.codecs import codec_spec
from storage.encodings import ENCODINGS, bytes_per_token, is_lossy, nonfinite_rows
from storage.errors import (
    LayoutMismatchError, StaleStoreError, StorageError, StoreAccessError, UnsupportedFormatError,
    UnsupportedLocationError,
)
from storage.locations import Location, disk_bytes, free_bytes, location, remove_tree
from storage.manifest import FieldSpec, Fingerprint
from storage.owner import OWNER_ENTRIES, owning
from storage.reader import Reader
from storage.shard_input import format_ranges
from storage.store import Store
from storage.verify import verify

__all__ = [
    "create_store", "open_store", "is_store", "verify", "codec_spec", "Store", "Reader", "Fingerprint", "FieldSpec",
    "STORE_ENTRIES", "StorageError", "StaleStoreError", "LayoutMismatchError", "StoreAccessError",
    "UnsupportedFormatError", "UnsupportedLocationError", "ENCODINGS", "bytes_per_token",
    "is_lossy", "nonfinite_rows", "format_ranges", "location", "Location", "remove_tree", "disk_bytes", "free_bytes",
    "blobs_for", "owning", "OWNER_ENTRIES",
]
