"""The output directory a job writes: refused when it is a file, held by the job's owner lock (`storage.owning`)
for the whole job, and an OSError writing it turned into one line."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator

import storage
from preinfer.errors import PreinferError, UsageError
from storage import Location, location


def check_not_a_file(out: Location, flag: str = "--out") -> None:
    """Refuse an output directory (given by `flag`) that is a file."""
    if out.exists() and not out.is_dir():
        raise UsageError(f"{flag} {out} is a file, not a directory")


@contextlib.contextmanager
def held_output(out: str | os.PathLike | Location, flag: str = "--out", temporary: bool = False
                ) -> Iterator[Location]:
    """Refuse `out` if it is a file, then hold its owner lock while the block runs (another live job's hold is
    an OutputBusyError naming it); `temporary`: see `storage.owning`. Yields `out` as a location."""
    where = location(out)
    check_not_a_file(where, flag)
    with storage.owning(where, flag, temporary=temporary):
        yield where


@contextlib.contextmanager
def writing(out: Location, stopped: Callable[[OSError], PreinferError], flag: str = "--out") -> Iterator[None]:
    """Map an OSError of the block to one line: a directory the job may not write (permission, a file in the
    way) is bad input naming `flag`; any other (a full disk, a failing device) is `stopped(err)`."""
    try:
        yield
    except (PermissionError, NotADirectoryError, FileExistsError) as err:
        raise UsageError(f"{flag} {out}: {err.strerror or err} ({err.filename or out})") from None
    except OSError as err:
        raise stopped(err) from None
