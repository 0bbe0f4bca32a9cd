"""Exceptions of the model side. The CLI maps UsageError to exit code 2 and every other PreinferError to 1."""


class PreinferError(Exception):
    """A failure the user can act on; the message says what and where."""


class UsageError(PreinferError):
    """Bad input from the user: a flag, a file, a model or a config value that cannot be used."""


class UnsupportedModelError(UsageError):
    """A model whose structure no adapter recognises."""


class DivergedError(PreinferError):
    """Training produced a non-finite loss or weights; the run stops before writing them."""


class CheckpointError(PreinferError):
    """A checkpoint that cannot be resumed from: a damaged file or a field out of its type or range."""


def first_line(error: BaseException) -> str:
    """An exception's message up to its first line break (a library's multi-line message in a one-line error)."""
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__
