"""Activation stores: sharded zarr v3 / safetensors / memory backends behind one small interface."""

from storage.errors import CorruptStoreError, IncompleteStoreError, StaleStoreError, StorageError

__all__ = ["StorageError", "StaleStoreError", "CorruptStoreError", "IncompleteStoreError"]
