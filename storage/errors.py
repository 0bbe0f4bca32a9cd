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


class LayoutMismatchError(StorageError):
    """A store exists with the same fingerprint but another layout; `differences` maps each differing entry
    ("format", "codec", "num_samples", "samples_per_shard", "field NAME") to (stored, requested)."""

    def __init__(self, message: str, differences: dict[str, tuple], remedy: str = "") -> None:
        self.differences = differences
        detail = ", ".join(f"{name} {stored!r} (requested {wanted!r})" for name, (stored, wanted) in differences.items())
        super().__init__(f"{message}: another layout: {detail}" + (f"; {remedy}" if remedy else ""))


class UnsupportedLocationError(StorageError):
    """A store location names a URL scheme stores cannot be written to, or whose package is not installed."""


class StoreAccessError(StorageError):
    """A store location that cannot be reached as the environment gives it: no credentials, an endpoint that does
    not answer. The user's to fix (a job's exit code 2); nothing was written."""
