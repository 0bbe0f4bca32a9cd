"""Activation stores: sharded zarr v3 / safetensors / memory backends behind one small interface."""

from storage.api import create_store, open_store
from storage.errors import (
    CorruptStoreError,
    IncompleteStoreError,
    StaleStoreError,
    StorageError,
    UnsupportedFormatError,
)
from storage.manifest import FORMAT_VERSION, FieldSpec, Fingerprint
from storage.reader import Reader
from storage.store import Store
from storage.verify import VerifyReport, verify

__all__ = [
    "create_store", "open_store", "verify", "Store", "Reader", "Fingerprint", "FieldSpec", "VerifyReport",
    "FORMAT_VERSION", "StorageError", "StaleStoreError", "CorruptStoreError", "IncompleteStoreError",
    "UnsupportedFormatError",
]
