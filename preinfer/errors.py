"""Exceptions of the model side and of `pipelines`: every error they raise is a PreinferError (tests/test_errors.py
checks it). The CLI maps UsageError to exit code 2 and every other PreinferError to 1."""

import errno


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
    seen = 0
    while err is not None and seen < 20:
        if isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if "[Errno 28]" in str(err) or "No space left on device" in str(err):
            return True
        err, seen = err.__cause__ or err.__context__, seen + 1
    return False
