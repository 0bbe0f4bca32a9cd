"""Faults of the disk for tests run in this process: a writer whose n-th call raises an OSError (a full disk, a
read-only file system; `FailingWrites` counts every write of the project's publishing writers), a real full or
read-only disk (`Tmpfs`), a command that stops on one and the same command once the fault is gone, and the bytes
of an output tree to compare."""

import errno
import functools
import importlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from tests.helpers.cli_run import failure_line, run_cli

ENOSPC = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
EROFS = OSError(errno.EROFS, os.strerror(errno.EROFS))


def files(root: Path) -> dict[str, bytes]:
    """Every file under `root` with its bytes; a manifest without its creation time."""
    found = {}
    for path in sorted(root.rglob("*")):
        if path.is_file():
            data = path.read_bytes()
            if path.name == "manifest.json":
                data = json.dumps({k: v for k, v in json.loads(data).items() if k != "created"}).encode()
            found[path.relative_to(root).as_posix()] = data
    return found


def raises_at(call: int, function, error: Exception, calls: dict | None = None):
    """`function`, except that its `call`-th call (1: the first; 0: none, to count them) raises `error` instead;
    `calls["n"]` counts the calls."""
    calls = {"n": 0} if calls is None else calls

    @functools.wraps(function)
    def failing(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == call:
            raise error
        return function(*args, **kwargs)

    return failing


def full_disk(monkeypatch, module: str, qualname: str, call: int, error: Exception = ENOSPC,
              calls: dict | None = None) -> None:
    """Make the `call`-th call of `module:qualname` (a writer) raise `error`, until monkeypatch.undo()."""
    owner = importlib.import_module(module)
    *path, name = qualname.split(".")
    for part in path:
        owner = getattr(owner, part)
    monkeypatch.setattr(owner, name, raises_at(call, getattr(owner, name), error, calls))


def stopped(argv: list[str], capsys, one_line: bool = True) -> str:
    """Run `preinfer ARGV` on a disk that fails: it exits 1 without a traceback; its one error line (the last of
    stderr when not `one_line`: a finished run's export prints transformers' progress bar first)."""
    code, _, err = run_cli(argv, capsys)
    assert code == 1 and "Traceback" not in err, err
    return failure_line(err) if one_line else err.strip().splitlines()[-1]


def works_once_freed(argv: list[str], capsys, monkeypatch) -> None:
    """With the disk's space back (the patched writer undone), `preinfer ARGV` ends with exit 0."""
    monkeypatch.undo()
    code, _, err = run_cli(argv, capsys)
    assert code == 0, err


# The modules whose writes go through `preinfer.atomic_write` (imported here first, so that every reference to its
# writers is bound before they are replaced).
WRITING_MODULES = ("pipelines.training.runner", "pipelines.store_training", "pipelines.data.token_store",
                   "pipelines.pipeline_parallel.stage", "pipelines.commands.bcd", "pipelines.commands.cache")


def _blob_path(blobs, key: str, _data: bytes) -> Path:
    """The file `LocalBlobs.write(key, data)` writes."""
    return blobs.root / key


class FailingWrites:
    """Every write of the project's own publishing writers, counted in order: `preinfer.atomic_write`'s
    `write_atomically` and `write_directory_atomically` (in every module that imported them) and storage's
    `LocalBlobs.write`, each of the paths under `under` (None: all). At the `at`-th (0: none, only counted; a path
    relative to `under`: the first write of that path) `before_fault` (given its path) runs, then the write raises
    `error` naming that path (`error` None: the write goes on, into what `before_fault` did to the disk)."""

    def __init__(self, monkeypatch, at: int | str = 0, error: OSError | None = ENOSPC, under: Path | None = None,
                 before_fault=None):
        import preinfer.atomic_write
        from storage.blobs import LocalBlobs

        for name in WRITING_MODULES:
            importlib.import_module(name)
        self.at, self.error, self.under, self.before_fault = at, error, under, before_fault
        self.paths: list[Path] = []
        for name in ("write_atomically", "write_directory_atomically"):
            original = getattr(preinfer.atomic_write, name)
            wrapper = self._counted(original, lambda path, *_: Path(path))
            for module in list(sys.modules.values()):
                if getattr(module, name, None) is original:
                    monkeypatch.setattr(module, name, wrapper)
        monkeypatch.setattr(LocalBlobs, "write", self._counted(LocalBlobs.write, _blob_path))

    def _counted(self, write, path_of):
        @functools.wraps(write)
        def counted(*args, **kwargs):
            path = path_of(*args)
            if self.under is None or path.is_relative_to(self.under):
                self.paths.append(path)
                if self._is_fault(path):
                    if self.before_fault is not None:
                        self.before_fault(path)
                    if self.error is not None:
                        raise OSError(self.error.errno, self.error.strerror, str(path))
            return write(*args, **kwargs)

        return counted

    def _is_fault(self, path: Path) -> bool:
        if isinstance(self.at, int):
            return len(self.paths) == self.at
        return path == self.under / self.at and self.paths.count(path) == 1


class Tmpfs:
    """A tmpfs mounted at `path` (root only), whose size and writability change while a command runs: a full disk
    and a read-only file system for real. `unmount` when done."""

    def __init__(self, path: Path, size: int = 64 << 20):
        path.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._mount("-t", "tmpfs", "-o", f"size={size}", "tmpfs")

    def _mount(self, *args: str) -> None:
        done = subprocess.run(["mount", *args, str(self.path)], capture_output=True, text=True)
        if done.returncode != 0:
            raise PermissionError(f"mount {' '.join(args)} {self.path}: {done.stderr.strip()}")

    def used(self) -> int:
        """Bytes in use."""
        usage = shutil.disk_usage(self.path)
        return usage.total - usage.free

    def leave_free(self, free: int) -> None:
        """Shrink (or grow) the file system to have `free` bytes (in whole pages) left."""
        self._mount("-o", f"remount,size={self.used() + free}")

    def read_only(self) -> None:
        self._mount("-o", "remount,ro")

    def writable(self, size: int = 64 << 20) -> None:
        self._mount("-o", f"remount,rw,size={size}")

    def unmount(self) -> None:
        subprocess.run(["umount", "-l", str(self.path)], check=True)
