"""How a command ends on an error: our exceptions and any OSError become one line on stderr and an exit code, never
a traceback."""

from __future__ import annotations

import sys
from collections.abc import Callable

from preinfer.errors import PreinferError, UsageError, remedy


def run_command(command: str, run: Callable[[], int | None]) -> int:
    """Run the command `command`; its exit code: `run`'s (0 for None), 2 on bad input (`_usage_errors`), 1 on
    another of our errors or an OSError, 130 on Ctrl-C, each with one line on stderr."""
    try:
        return run() or 0
    except _usage_errors() as err:
        return _fail(command, err, 2)
    except _failures() as err:
        return _fail(command, err, 1)
    except OSError as err:  # one no job maps to its own line: what failed and where
        return _fail(command, stopped("the job stopped", err, "run the same command again"), 1)
    except KeyboardInterrupt:
        print(f"preinfer {command}: interrupted", file=sys.stderr)
        return 130


def _fail(command: str, err: Exception, code: int) -> int:
    print(f"preinfer {command}: error: {err}", file=sys.stderr)
    return code


def _usage_errors() -> tuple[type[Exception], ...]:
    """The errors that end a command with exit code 2, bad input: UsageError, and once `storage` is loaded a store
    location that cannot be used as the environment gives it (StoreAccessError, UnsupportedLocationError) or a
    store in a format this version cannot read (UnsupportedFormatError)."""
    storage = sys.modules.get("storage")
    if storage is None:
        return (UsageError,)
    return UsageError, storage.StoreAccessError, storage.UnsupportedLocationError, storage.UnsupportedFormatError


def _failures() -> tuple[type[Exception], ...]:
    """The errors that end a command with one line and exit code 1: PreinferError, and StorageError once a
    command has loaded `storage` (importing it only to catch its error would load it for every command)."""
    storage_error = getattr(sys.modules.get("storage"), "StorageError", None)
    return (PreinferError,) if storage_error is None else (PreinferError, storage_error)


def stopped(what: str, err: OSError, then: str) -> PreinferError:
    """The one line of a job an OSError stopped: `what` failed, why and where, the first thing to do
    (`preinfer.errors.remedy`: free space on a full disk, make it writable on a read-only one), then `then` (what
    continues the job)."""
    where = f" at {err.filename}" if err.filename else ""
    return PreinferError(f"{what} ({err.strerror or err}{where}); {remedy(err)}, then {then}")
