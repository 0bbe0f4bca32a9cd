"""Exceptions of the model side and of `pipelines`: every error they raise is a PreinferError (tests/test_errors.py
checks it). The CLI maps UsageError to exit code 2 and every other PreinferError to 1."""


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


def first_line(error: BaseException) -> str:
    """An exception's message up to its first line break (a library's multi-line message in a one-line error)."""
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__
