"""Exceptions of the model side and of `pipelines`: every error they raise is a PreinferError (tests/test_errors.py
checks it). The CLI maps UsageError to exit code 2 and every other PreinferError to 1."""

import errno
import os


class PreinferError(Exception):
    """A failure the user can act on; the message says what and where."""


class UsageError(PreinferError):
    """Bad input from the user: a flag, a file, a model or a config value that cannot be used."""


class UnsupportedModelError(UsageError):
    """A model whose structure no adapter recognises."""


class BoundaryStateError(PreinferError):
    """A boundary state or layer range that does not fit the call: fields a state has no place for, a loss
    without labels, layers outside the model."""


class DivergedError(PreinferError):
    """Training produced a non-finite loss or weights; the run stops before writing them."""


class CheckpointError(PreinferError):
    """A checkpoint that cannot be resumed from: a damaged file or a field out of its type or range."""


class CheckpointWriteError(PreinferError):
    """Writing a checkpoint failed (a full disk, a failing device); the message says which complete one is kept."""


def first_line(error: BaseException) -> str:
    """An exception's message up to its first line break (a library's multi-line message in a one-line error)."""
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def is_disk_full(err: BaseException | None) -> bool:
    """Whether `err` (or what caused it; or its text, for an exception that crossed a process) is a full disk."""
    return _caused_by(err, (errno.ENOSPC, errno.EDQUOT))


def remedy(err: BaseException | None) -> str:
    """The first thing to do about a write that `err` stopped: free space on a full disk, make the place writable
    on a read-only file system (or a refused permission), else fix that."""
    if is_disk_full(err):
        return "free space"
    return "make it writable" if _caused_by(err, (errno.EROFS, errno.EACCES, errno.EPERM)) else "fix that"


def _caused_by(err: BaseException | None, numbers: tuple[int, ...]) -> bool:
    """Whether `err`, or what caused it, is an OSError of one of `numbers` (or names one in its text: an exception
    that crossed a process, a library's own report)."""
    texts = [f"[Errno {number}]" for number in numbers] + [os.strerror(number) for number in numbers]
    seen = 0
    while err is not None and seen < 20:
        if isinstance(err, OSError) and err.errno in numbers:
            return True
        if any(text in str(err) for text in texts):
            return True
        err, seen = err.__cause__ or err.__context__, seen + 1
    return False
