"""Named byte blobs under a store's root (local directory, fsspec URL, or process memory): atomic writes,
listing with sizes, and one-writer-per-name locks (on a local disk, lock files under `locks/`)."""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import threading
import uuid
from abc import ABC, abstractmethod
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from storage.errors import StorageError
from storage.locations import UrlPath, location, storage_options
from storage.owner import OWNER_ENTRIES

# Where LocalBlobs keeps its writers' lock files (removed again once the store is complete).
LOCKS = "locks"
_PROCESS_LOCKS: dict[tuple[str, str], threading.Lock] = {}
_PROCESS_LOCKS_GUARD = threading.Lock()


@contextlib.contextmanager
def _process_lock(location: str, key: str) -> Iterator[None]:
    """Hold an in-process lock on (location, key); raise StorageError if another thread holds it."""
    with _PROCESS_LOCKS_GUARD:
        lock = _PROCESS_LOCKS.setdefault((location, key), threading.Lock())
    if not lock.acquire(blocking=False):
        raise StorageError(f"{location}: '{key}' is being written by another writer in this process")
    try:
        yield
    finally:
        lock.release()


class Blobs(ABC):
    """Byte blobs addressed by '/'-separated keys relative to a root. A kind of blobs provides the abstract
    methods; `zarr_store` only the kinds a zarr store is written to (not process memory)."""

    location: str

    @abstractmethod
    def read(self, key: str) -> bytes:
        """The bytes of `key` (FileNotFoundError if absent, as a file or an fsspec object)."""

    def read_buffer(self, key: str) -> np.ndarray:
        """The bytes of `key` as a writable uint8 array that the caller owns (tensors may view it without a copy)."""
        return np.frombuffer(bytearray(self.read(key)), dtype=np.uint8)

    @abstractmethod
    def write(self, key: str, data: bytes) -> None:
        """Publish `data` under `key` atomically: readers see the old blob, or all of the new one."""

    @abstractmethod
    def size(self, key: str) -> int | None:
        """The size of `key` in bytes, or None if it does not exist."""

    @abstractmethod
    def list(self, prefix: str) -> dict[str, int]:
        """Every key under `prefix` (recursively) with its size."""

    def sync(self, key: str) -> None:
        """Make a blob written by someone else (zarr) durable before it is declared complete."""

    @abstractmethod
    def remove_all(self) -> None:
        """Delete every blob under the root but the owner lock (`storage.owner`) of the job doing it."""

    @abstractmethod
    def remove(self, prefix: str) -> None:
        """Delete every blob under the directory `prefix` (nothing if there is none)."""

    def clear_locks(self) -> None:
        """Delete the writers' lock files, once no writer needs them (a complete store)."""

    def will_need(self, key: str) -> None:
        """Hint that `key` will be read soon (starts OS readahead where there is one)."""

    def lock(self, key: str) -> contextlib.AbstractContextManager:
        """Exclusive writer lock on `key`; raises StorageError at once if another writer holds it."""
        return _process_lock(self.location, key)

    def zarr_store(self, prefix: str):
        """A zarr store rooted at `prefix`."""
        raise StorageError(f"{self.location}: {type(self).__name__} cannot hold a zarr store")


class LocalBlobs(Blobs):
    """Blobs in a local directory; writes go through a temporary name, fsync and rename (the steps of
    `preinfer.atomic_write`, which storage may not import: tests/test_atomic_write.py holds both to one contract)."""

    def __init__(self, root: str | os.PathLike) -> None:
        self.root = Path(root)
        self.location = str(self.root)

    def read(self, key: str) -> bytes:
        return (self.root / key).read_bytes()

    def read_buffer(self, key: str) -> np.ndarray:
        """One sequential read straight into a fresh (not zero-filled) buffer: no intermediate bytes object."""
        with open(self.root / key, "rb", buffering=0) as f:
            size = os.fstat(f.fileno()).st_size
            buf = np.empty(size, dtype=np.uint8)
            view, done = memoryview(buf), 0
            while done < size:
                got = f.readinto(view[done:])
                if not got:  # the file shrank under us: hand back what is there, the size check reports it
                    return buf[:done]
                done += got
        return buf

    def write(self, key: str, data: bytes) -> None:
        path = self.root / key
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        try:
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
        self._sync_dir(path.parent)

    def size(self, key: str) -> int | None:
        try:
            return (self.root / key).stat().st_size
        except FileNotFoundError:
            return None

    def list(self, prefix: str) -> dict[str, int]:
        found = {}
        for dirpath, _, names in os.walk(self.root / prefix):
            for name in names:
                if not name.startswith("."):
                    path = Path(dirpath, name)
                    found[path.relative_to(self.root).as_posix()] = path.stat().st_size
        return found

    def sync(self, key: str) -> None:
        with open(self.root / key, "rb") as f:
            os.fsync(f.fileno())
        self._sync_dir((self.root / key).parent)

    def remove_all(self) -> None:
        if not self.root.is_dir():
            return
        for entry in self.root.iterdir():
            if entry.name in OWNER_ENTRIES:
                continue
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)
        self._sync_dir(self.root)

    def remove(self, prefix: str) -> None:
        directory = self.root / prefix
        if directory.is_dir():
            shutil.rmtree(directory, ignore_errors=True)
            self._sync_dir(self.root)

    def clear_locks(self) -> None:
        self.remove(LOCKS)

    def will_need(self, key: str) -> None:
        try:
            fd = os.open(self.root / key, os.O_RDONLY)
        except OSError:
            return  # a missing file is reported when it is read
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
        finally:
            os.close(fd)

    @contextlib.contextmanager
    def lock(self, key: str) -> Iterator[None]:
        """An OS file lock (released by the kernel if the writer dies), plus the in-process lock."""
        path = self.root / LOCKS / f"{key.replace('/', '_')}.lock"
        path.parent.mkdir(parents=True, exist_ok=True)
        with _process_lock(self.location, key), open(path, "a+") as f:
            try:
                fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                f.seek(0)
                holder = f.read().strip() or "unknown"
                raise StorageError(
                    f"{self.location}: '{key}' is being written by another process ({holder}); exactly one "
                    f"writer may write a shard"
                ) from None
            f.truncate(0)
            f.write(f"pid {os.getpid()} on {os.uname().nodename}")
            f.flush()
            try:
                yield
            finally:
                fcntl.flock(f.fileno(), fcntl.LOCK_UN)

    def zarr_store(self, prefix: str):
        from zarr.storage import LocalStore

        return LocalStore(self.root / prefix)

    @staticmethod
    def _sync_dir(directory: Path) -> None:
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


class FsspecBlobs(Blobs):
    """Blobs behind an fsspec URL (e.g. memory://, s3://); each write is one PUT, so a reader sees all of a blob or
    none of it. The writer lock holds within one process only: on object storage the caching job keeps exactly
    one writer per shard (each shard is one task)."""

    def __init__(self, url: UrlPath) -> None:
        self.location = url.url
        self.fs, self.root = url.fs, url.fs_path

    def _path(self, key: str) -> str:
        return f"{self.root}/{key}"

    def read(self, key: str) -> bytes:
        return self.fs.cat_file(self._path(key))

    def write(self, key: str, data: bytes) -> None:
        self.fs.pipe_file(self._path(key), bytes(data))

    def size(self, key: str) -> int | None:
        try:
            return self.fs.size(self._path(key))
        except FileNotFoundError:
            return None

    def list(self, prefix: str) -> dict[str, int]:
        base = self._path(prefix)
        if not self.fs.exists(base):
            return {}
        found = self.fs.find(base, detail=True)
        root = self.fs._strip_protocol(self.root).rstrip("/")
        return {self.fs._strip_protocol(p)[len(root) + 1:]: info["size"] for p, info in found.items()}

    def remove_all(self) -> None:
        if not self.fs.exists(self.root):
            return
        keep = {self._path(name) for name in OWNER_ENTRIES}
        doomed = [p for p in self.fs.ls(self.root, detail=False) if p.rstrip("/") not in keep]
        if doomed:
            self.fs.rm(doomed, recursive=True)

    def remove(self, prefix: str) -> None:
        if self.fs.exists(self._path(prefix)):
            self.fs.rm(self._path(prefix), recursive=True)

    def zarr_store(self, prefix: str):
        from zarr.storage import FsspecStore

        url = f"{self.location}/{prefix}"
        return FsspecStore.from_url(url, storage_options=storage_options(url) or None)


class MemoryBlobs(Blobs):
    """Blobs in a dict of this process; also holds the tensors of a memory-backed store."""

    def __init__(self, name: str) -> None:
        self.location = name
        self.blobs: dict[str, bytes] = {}
        self.tensors: dict[int, dict] = {}

    def read(self, key: str) -> bytes:
        try:
            return self.blobs[key]
        except KeyError:
            raise FileNotFoundError(key) from None

    def write(self, key: str, data: bytes) -> None:
        self.blobs[key] = bytes(data)

    def size(self, key: str) -> int | None:
        return len(self.blobs[key]) if key in self.blobs else None

    def list(self, prefix: str) -> dict[str, int]:
        return {key: len(data) for key, data in self.blobs.items() if key.startswith(prefix)}

    def remove_all(self) -> None:
        self.blobs.clear()
        self.tensors.clear()

    def remove(self, prefix: str) -> None:
        for key in [k for k in self.blobs if k.startswith(prefix.rstrip("/") + "/")]:
            del self.blobs[key]


def blobs_for(path: str | os.PathLike | UrlPath) -> Blobs:
    """The blob layer of a local path, file:// path, or fsspec URL (UnsupportedLocationError for a scheme stores
    cannot be written to)."""
    where = location(path)
    return FsspecBlobs(where) if isinstance(where, UrlPath) else LocalBlobs(where)
