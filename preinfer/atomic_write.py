"""The one atomic write of a file: `write_atomically` publishes a file whole or not at all, durably, with the
permissions the umask gives (`give_umask_mode`, which also mends what a library's own writer made 0600).

The files the project publishes whole go through it: a run directory's config.toml, inputs.json and summary.json
and its metrics log cut back on --resume, a checkpoint's files, a pipeline's gathered weights, and the token store's
staged files and description. A directory published whole, the export (whose files transformers' `save_pretrained`
and a tokenizer's own writers write), goes through `write_directory_atomically`; a checkpoint directory is published
by renames of its own (`preinfer.checkpoint`), made durable with `fsync_directory`. A failure of either is an
OSError naming the path being published (a writer's own error of the disk, such as safetensors' "os error 28", too).

It lives here, on the model side, because the model side writes files of its own (checkpoints, the run directory)
and may import nothing of `storage` or `pipelines`; `pipelines` imports it from here. `storage` may import nothing
of ours either (the design's rule), so its blob layer publishes a store's blobs itself (`storage.blobs.Blobs.write`,
one verb over three places: one PUT on object storage, a dict in process memory, and on a local disk the same steps
as below, in `LocalBlobs.write`). That local case is the one twin left, by the rule; tests/test_atomic_write.py
holds both to one contract: the umask's mode, and a file complete or absent after a crash between the write and the
rename.
"""

from __future__ import annotations

import os
import re
import shutil
import uuid
from collections.abc import Callable, Iterable
from pathlib import Path

Content = str | bytes | Callable[[Path], object]


def write_atomically(path: str | os.PathLike, content: Content) -> None:
    """Publish `content` at `path`: written to a temporary beside it (text as UTF-8, bytes as they are, or a
    callable given the temporary's path writes it: a writer of its own such as safetensors' `save_file`), made
    durable (the file fsynced), given the mode the umask gives a new file, renamed into place, and the rename made
    durable (the directory fsynced). A reader sees the old file or the whole new one; a failed write leaves the
    old file as it was and no temporary; a crash may leave a temporary, hidden: `.NAME.tmp-...`."""
    path = Path(path)
    temporary = _hidden_sibling(path, "tmp")
    try:
        with open(temporary, "xb") as stream:
            if not callable(content):
                stream.write(content.encode("utf-8") if isinstance(content, str) else content)
        if callable(content):
            content(temporary)
        give_umask_mode([temporary])
        _fsync(temporary, os.O_RDONLY)
        os.replace(temporary, path)
        fsync_directory(path.parent)
    except Exception as err:
        _raise_publish_error(err, path)
        raise
    finally:
        temporary.unlink(missing_ok=True)


def write_directory_atomically(path: str | os.PathLike, write: Callable[[Path], object]) -> bool:
    """Publish the directory `path` whole: `write` (given a hidden temporary sibling) fills it, its files are made
    durable with the umask's mode, the previous `path` is moved aside to a hidden sibling, the new one renamed into
    place and the previous deleted. A failed write leaves the previous directory as it was and no temporary; a
    crash leaves the previous directory or the new one at `path` (between the renames neither, the previous as
    `.NAME.old-...`), and the next call removes what a crash left. False (nothing published, the previous kept)
    when `write` wrote no file."""
    path = Path(path)
    for stale in path.parent.glob(f".{path.name}.*-*"):
        if _LEFTOVER.fullmatch(stale.name.removeprefix(f".{path.name}")):
            shutil.rmtree(stale, ignore_errors=True)
    temporary, previous = _hidden_sibling(path, "tmp"), _hidden_sibling(path, "old")
    try:
        temporary.mkdir()
        write(temporary)
        files = sorted(file for file in temporary.rglob("*") if file.is_file())
        if not files:
            return False
        give_umask_mode(files)
        for file in files:
            _fsync(file, os.O_RDONLY)
        fsync_directory(temporary)
        _replace_directory(temporary, path, previous)
    except Exception as err:
        _raise_publish_error(err, path)
        raise
    finally:
        shutil.rmtree(temporary, ignore_errors=True)
    shutil.rmtree(previous, ignore_errors=True)
    return True


def _replace_directory(new: Path, path: Path, previous: Path) -> None:
    """Rename `new` to `path`, what was there moved to `previous` first (and back, if `new` cannot take its place)."""
    if path.exists():
        os.replace(path, previous)
    try:
        os.replace(new, path)
    except OSError:
        if previous.exists():
            os.replace(previous, path)
        raise
    fsync_directory(path.parent)


# What `_hidden_sibling` names, after the published name: the leftovers of a crash that the next publish removes.
_LEFTOVER = re.compile(r"\.(tmp|old)-\d+-[0-9a-f]{8}")
# A writer's own report of an operating system error (Rust's std::io::Error, as safetensors raises it).
_OS_ERROR_TEXT = re.compile(r"\(os error (\d+)\)")


def _hidden_sibling(path: Path, kind: str) -> Path:
    """A hidden name beside `path`, unique to this call: `.NAME.KIND-PID-HEX`."""
    return path.with_name(f".{path.name}.{kind}-{os.getpid()}-{uuid.uuid4().hex[:8]}")


def _raise_publish_error(err: Exception, path: Path) -> None:
    """Raise the error of a failed publish of `path` as an OSError naming `path`: `err`'s own error number, or the
    one a writer reported in its text (as safetensors reports a full disk); return when `err` has none."""
    found = _OS_ERROR_TEXT.search(str(err)) if not isinstance(err, OSError) else None
    number = err.errno if isinstance(err, OSError) else int(found.group(1)) if found else None
    if number is not None:
        raise OSError(number, os.strerror(number), str(path)) from err


def fsync_directory(directory: Path) -> None:
    """Make the entries of `directory` durable (a rename into it, a new file; a checkpoint's directory renamed)."""
    _fsync(directory, os.O_RDONLY | os.O_DIRECTORY)


def give_umask_mode(files: Iterable[Path]) -> None:
    """Give each of `files` the mode the process's umask gives a new file (0644 under umask 022), whatever mode
    its writer chose (safetensors, and transformers' `save_pretrained` through it, write 0600)."""
    mode = 0o666 & ~_umask()
    for file in files:
        os.chmod(file, mode)


def _umask() -> int:
    """The process's umask, read without changing it (setting it to read it would race other threads' writes)."""
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            return next(int(line.split()[1], 8) for line in status if line.startswith("Umask:"))
    except (OSError, StopIteration, IndexError, ValueError):  # not Linux: read it by setting it
        mask = os.umask(0o022)
        os.umask(mask)
        return mask


def _fsync(path: Path, flags: int) -> None:
    fd = os.open(path, flags | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
