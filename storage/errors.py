"""Exceptions of the storage side, all under one base class."""


class StorageError(Exception):
    """Any failure to create, write, open or read a store; the message names the store and what went wrong."""


class StaleStoreError(StorageError):
    """The store was made for another fingerprint (other prefix weights, data, boundary, dtype...)."""


class CorruptStoreError(StorageError):
    """Stored bytes fail their checksum, or files are missing or truncated."""


class IncompleteStoreError(StorageError):
    """Some shards are not written yet; the store can be resumed but not read."""


class UnsupportedFormatError(StorageError):
    """The store was written in a format version (or by a backend) this tool cannot read."""
