"""Owner locks: the exclusive hold one job has on its output directory (a run directory, a store or cache, a token
store) for the whole job, so that a second job on the same output stops at once instead of writing beside it.

On a local or shared filesystem the lock is an OS file lock (`flock`) on `OUT/.owner.lock`, which also records the
holder's PID and host. The kernel releases it when the holder dies, however it dies, so the next job takes it over
and says so; Linux maps `flock` on NFS to the server's locks. On object storage (s3://), where there are no locks,
the lock is a lease object `OUT/.owner.json` naming the holder and an expiry time `LEASE_SECONDS` ahead, renewed by
a heartbeat thread every `LEASE_SECONDS / 4`; a lease whose expiry has passed (its holder died or lost the store)
is taken over, and so is one held by a process of this host that is no longer running. A new holder writes its lease, waits `SETTLE_SECONDS` and reads it back, so that of two jobs
starting together the one whose write landed last holds it and the other stops.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import stat
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

from storage.errors import StorageError
from storage.locations import Location, UrlPath, location

LOCK_FILE = ".owner.lock"  # on a filesystem
LEASE_OBJECT = ".owner.json"  # on object storage
OWNER_ENTRIES = frozenset({LOCK_FILE, LEASE_OBJECT})
LEASE_SECONDS = 60.0
SETTLE_SECONDS = 0.5
_HELD: set[str] = set()  # the outputs this process holds
_HELD_GUARD = threading.Lock()


class OutputBusyError(StorageError):
    """Another live job holds the output directory."""


class OwnerLockError(StorageError):
    """The output directory, or the lock file in it, cannot be made or is not a plain file (a symlink, a
    directory, a fifo): refused before anything is written."""


def holder_text(pid: object, host: object) -> str:
    return f"pid {pid} on host {host}"


def _busy(out: Location, what: str, holder: str) -> OutputBusyError:
    return OutputBusyError(f"{what} {out} is held by another job ({holder}); wait for it to finish or choose "
                           f"another {what}")


def _say(line: str) -> None:
    print(line, file=sys.stderr)


@contextlib.contextmanager
def owning(out: str | os.PathLike | Location, what: str = "--out", temporary: bool = False,
           say: Callable[[str], None] = _say) -> Iterator[None]:
    """Hold the owner lock of the directory `out` (created if need be) while the block runs; raises
    OutputBusyError naming the holder if another live job holds it. A job that holds it already (this process)
    holds it again. `what` names the output in messages (the flag that chose it); `temporary`: the directory goes
    at release if it is empty then (also when it was there before: a scratch output); `say` gets the one line about
    a stale lock taken over."""
    where = location(out)
    key = str(where) if isinstance(where, UrlPath) else str(where.absolute())
    with _HELD_GUARD:
        again = key in _HELD
        _HELD.add(key)
    if again:
        yield
        return
    held = _hold_lease(where, what, say) if isinstance(where, UrlPath) else _hold_file(where, what, temporary, say)
    try:
        with held:
            yield
    finally:
        with _HELD_GUARD:
            _HELD.discard(key)


@contextlib.contextmanager
def _hold_file(out: Path, what: str, temporary: bool, say: Callable[[str], None]) -> Iterator[None]:
    created = [p for p in (out, *out.absolute().parents) if not p.exists()] or ([out] if temporary else [])
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise OwnerLockError(f"{what} {out}: cannot create the directory ({error.strerror or error}); choose a "
                             f"writable place") from None
    path = out / LOCK_FILE
    while True:
        fd = _open_lock(path, out, what)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 4096, 0).decode(errors="replace").strip() or "holder unknown"
            os.close(fd)
            raise _busy(out, what, holder) from None
        try:
            same = os.fstat(fd).st_ino == os.stat(path).st_ino
        except FileNotFoundError:  # the previous holder removed it as it released it: lock the new file
            same = False
        if same:
            break
        os.close(fd)
    try:
        previous = os.pread(fd, 4096, 0).decode(errors="replace").strip()
        if previous:
            say(f"{what} {out}: took over the owner lock of a job that is no longer running ({previous})")
        os.ftruncate(fd, 0)
        os.pwrite(fd, holder_text(os.getpid(), socket.gethostname()).encode(), 0)
        os.fsync(fd)
        yield
    finally:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()  # while locked: a job waiting on this file sees it replaced and locks the new one
        os.close(fd)
        for directory in created:  # a job that wrote nothing (or a scratch output, emptied) leaves nothing
            if not directory.is_dir() or any(directory.iterdir()):
                break
            directory.rmdir()


def _open_lock(path: Path, out: Path, what: str) -> int:
    """The lock file opened for reading and writing (created if need be), never through a symlink; anything but a
    plain file in its place is refused in one line."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o644)
    except OSError as error:
        raise _not_a_lock(path, out, what, error) from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise _not_a_lock(path, out, what, None)
    return fd


# What to do about a lock file that cannot be created, by its error: a read-only or refused directory, a full disk.
_REMEDIES = {errno.EROFS: "make it writable", errno.EACCES: "make it writable", errno.EPERM: "make it writable",
             errno.ENOSPC: "free space", errno.EDQUOT: "free space"}


def _not_a_lock(path: Path, out: Path, what: str, error: OSError | None) -> OwnerLockError:
    """The one line about a lock file that cannot be used: what stands in its place, or why it cannot be opened
    and what to do."""
    try:
        mode = os.lstat(path).st_mode
    except OSError:
        mode = 0
    kinds = {"a symbolic link": stat.S_ISLNK, "a directory": stat.S_ISDIR, "a fifo": stat.S_ISFIFO,
             "a socket": stat.S_ISSOCK}
    kind = next((name for name, test in kinds.items() if test(mode)), None)
    if kind is None and mode and not stat.S_ISREG(mode):
        kind = "not a plain file"
    if kind:
        problem = f"is {kind}, where a job keeps a plain file; remove it (nothing was written)"
    else:
        reason = (error.strerror or str(error)) if error is not None else "unknown"
        remedy = _REMEDIES.get(getattr(error, "errno", None), "fix that")
        problem = f"cannot be opened ({reason}; nothing was written); {remedy}, then run the same command again"
    return OwnerLockError(f"{what} {out}: its owner lock {path.name} {problem}")


class _Lease:
    """The lease object of one holder: written, renewed by a heartbeat thread, and deleted at release."""

    def __init__(self, out: UrlPath) -> None:
        self.fs, self.key = out.fs, f"{out.fs_path}/{LEASE_OBJECT}"
        self.token = uuid.uuid4().hex
        self.record = {"pid": os.getpid(), "host": socket.gethostname(), "token": self.token}
        self.stop = threading.Event()

    def read(self) -> dict | None:
        try:
            record = json.loads(self.fs.cat_file(self.key))
        except FileNotFoundError:
            return None
        except ValueError:
            return {}  # a garbled lease holds nothing
        return record if isinstance(record, dict) else {}

    def write(self) -> None:
        record = {**self.record, "expires": time.time() + LEASE_SECONDS}
        self.fs.pipe_file(self.key, json.dumps(record).encode())

    def renew(self) -> None:
        while not self.stop.wait(LEASE_SECONDS / 4):
            current = self.read()
            if current is None or current.get("token") != self.token:
                return  # taken over after an expiry: the other holder's lease stands
            self.write()

    def release(self) -> None:
        self.stop.set()
        current = self.read()
        if current is not None and current.get("token") == self.token:
            self.fs.rm_file(self.key)


def _gone(record: dict) -> bool:
    """Whether the holder of a lease was a process of this host that is no longer running."""
    if record.get("host") != socket.gethostname() or not isinstance(record.get("pid"), int):
        return False
    try:
        os.kill(record["pid"], 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # alive, another user's
        return False
    return False


@contextlib.contextmanager
def _hold_lease(out: UrlPath, what: str, say: Callable[[str], None]) -> Iterator[None]:
    lease = _Lease(out)
    current = lease.read()
    if current:
        holder = holder_text(current.get("pid", "?"), current.get("host", "?"))
        if float(current.get("expires", 0)) > time.time() and not _gone(current):
            raise _busy(out, what, holder)
        say(f"{what} {out}: took over the owner lease of a job that is no longer running ({holder})")
    lease.write()
    time.sleep(SETTLE_SECONDS)
    winner = lease.read() or {}
    if winner.get("token") != lease.token:
        raise _busy(out, what, holder_text(winner.get("pid", "?"), winner.get("host", "?")))
    heartbeat = threading.Thread(target=lease.renew, name="preinfer-owner-lease", daemon=True)
    heartbeat.start()
    try:
        yield
    finally:
        lease.release()
        heartbeat.join()
