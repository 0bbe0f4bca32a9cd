"""The one atomic write of a file: `write_atomically` publishes a file whole or not at all, durably, with the
permissions the umask gives (`give_umask_mode`, which also mends what a library's own writer made 0600).

The files the project publishes whole go through it: a run directory's config.toml, inputs.json and summary.json
and its metrics log cut back on --resume, a checkpoint's files, the export's weights (the export of a whole model,
which transformers' `save_pretrained` writes, gets the umask's mode after it), a pipeline's gathered weights, and
the token store's staged files and description. A checkpoint directory is published by a rename of its own
(`preinfer.checkpoint`), made durable with `fsync_directory`.

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
    temporary = path.with_name(f".{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        with open(temporary, "xb") as stream:
            if not callable(content):
                stream.write(content.encode("utf-8") if isinstance(content, str) else content)
        if callable(content):
            content(temporary)
        give_umask_mode([temporary])
        _fsync(temporary, os.O_RDONLY)
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)
    fsync_directory(path.parent)


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
