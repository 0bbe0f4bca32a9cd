"""The one atomic write (`preinfer.atomic_write`, issue 44 part 6; issue 48 case 14): a file it writes has the mode
the umask gives (also what a library's own writer made 0600), and is complete or absent after a crash between the
write and the rename; storage's blob layer, which may not import it, is held to the same contract. A directory
published whole (the export) is the previous one or the whole new one, after a failure or a crash. A real tiny run
writes every file of its directory, the checkpoint's and the export's weights too, with the umask's mode."""

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from pipelines.pipeline_parallel.stage import gather_weights
from preinfer.atomic_write import give_umask_mode, write_atomically, write_directory_atomically
from storage import blobs_for
from tests.helpers.cli_run import run_cli

REPO = Path(__file__).resolve().parents[1]
TENSORS = {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3)}


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.fixture
def umask():
    """Set the process's umask for the test (`umask(0o077)`), the one before put back after it."""
    before = os.umask(0o022)
    yield os.umask
    os.umask(before)


def safetensors_writer(file: Path) -> None:
    save_file(TENSORS, str(file))


def blob_writer(path: Path, content: bytes) -> None:
    blobs_for(path.parent).write(path.name, content)


WRITES = {
    "text": lambda path: write_atomically(path, "grüße\n"),
    "bytes": lambda path: write_atomically(path, b"\x00\x01"),
    "safetensors": lambda path: write_atomically(path, safetensors_writer),
    "storage blob": lambda path: blob_writer(path, b"\x00\x01"),
}


@pytest.mark.parametrize("umask_value, expected", [(0o022, 0o644), (0o077, 0o600), (0o002, 0o664)])
@pytest.mark.parametrize("write", list(WRITES))
def test_a_written_file_has_the_mode_the_umask_gives(tmp_path, umask, umask_value, expected, write):
    umask(umask_value)
    path = tmp_path / "file"
    WRITES[write](path)
    assert mode(path) == expected
    assert [p.name for p in tmp_path.iterdir()] == ["file"]  # no temporary left


def test_safetensors_alone_writes_0600_which_is_why_its_writes_are_mended(tmp_path, umask):
    """The fact the callable form answers: safetensors' own writer ignores the umask."""
    save_file(TENSORS, str(tmp_path / "plain.safetensors"))
    assert mode(tmp_path / "plain.safetensors") == 0o600
    give_umask_mode([tmp_path / "plain.safetensors"])
    assert mode(tmp_path / "plain.safetensors") == 0o644


def test_the_content_is_what_was_written(tmp_path):
    write_atomically(tmp_path / "a.txt", "grüße\n")
    write_atomically(tmp_path / "b.bin", b"\xff\x00")
    write_atomically(tmp_path / "c.safetensors", safetensors_writer)
    assert (tmp_path / "a.txt").read_bytes() == "grüße\n".encode()
    assert (tmp_path / "b.bin").read_bytes() == b"\xff\x00"
    assert torch.equal(load_file(str(tmp_path / "c.safetensors"))["w"], TENSORS["w"])


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path):
    path = tmp_path / "file"
    write_atomically(path, "old")

    def half(file: Path) -> None:
        file.write_text("half of the n")
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError):
        write_atomically(path, half)
    assert path.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["file"]


def export_writer(*names: str, fail_at: str | None = None, error: Exception | None = None):
    """A writer of a directory's files `names` (each holding its name), raising `error` as it writes `fail_at`."""
    def write(directory: Path) -> None:
        for name in names:
            if name == fail_at:
                (directory / name).write_text("half")
                raise error
            (directory / name).write_text(name)
    return write


def tree(root: Path) -> dict[str, str]:
    return {p.relative_to(root).as_posix(): p.read_text() for p in sorted(root.rglob("*")) if p.is_file()}


def test_a_directory_is_published_whole_and_replaces_the_previous_one(tmp_path):
    assert write_directory_atomically(tmp_path / "export", export_writer("config.json", "model.safetensors"))
    assert write_directory_atomically(tmp_path / "export", export_writer("config.json", "tokenizer.json"))
    assert tree(tmp_path) == {"export/config.json": "config.json", "export/tokenizer.json": "tokenizer.json"}


@pytest.mark.parametrize("fail_at", ["config.json", "model.safetensors", "tokenizer.json"])
@pytest.mark.parametrize("error", [OSError(28, "No space left on device"), OSError(30, "Read-only file system"),
                                   RuntimeError("Error while serializing: I/O error: No space left on device "
                                                "(os error 28)")], ids=["ENOSPC", "EROFS", "writer's own text"])
def test_a_directory_whose_write_fails_at_any_file_leaves_the_previous_one_and_no_temporary(tmp_path, fail_at,
                                                                                           error):
    """The previous export stays bit for bit; the failure is an OSError of the error's number naming the directory
    (a writer's own report of one, as safetensors' "os error 28", too)."""
    names = ("config.json", "model.safetensors", "tokenizer.json")
    write_directory_atomically(tmp_path / "export", export_writer(*names))
    with pytest.raises(OSError) as failure:
        write_directory_atomically(tmp_path / "export", export_writer(*names, fail_at=fail_at, error=error))
    assert (failure.value.errno, failure.value.filename) == (28 if "28" in str(error) else 30,
                                                             str(tmp_path / "export"))
    assert tree(tmp_path) == {f"export/{name}": name for name in names}


@pytest.mark.parametrize("umask_value, expected", [(0o022, 0o644), (0o077, 0o600)])
def test_a_published_directory_s_files_have_the_mode_the_umask_gives(tmp_path, umask, umask_value, expected):
    """Also the files a library's own writer made 0600 (safetensors, as transformers' `save_pretrained` writes)."""
    umask(umask_value)
    write_directory_atomically(tmp_path / "export", lambda directory: safetensors_writer(directory / "w"))
    assert mode(tmp_path / "export" / "w") == expected


def test_a_directory_written_empty_is_not_published(tmp_path):
    write_directory_atomically(tmp_path / "export", export_writer("config.json"))
    assert not write_directory_atomically(tmp_path / "export", export_writer())
    assert tree(tmp_path) == {"export/config.json": "config.json"}


def test_the_leftovers_of_a_crashed_publish_are_removed_by_the_next_and_nothing_else(tmp_path):
    for leftover in (".export.tmp-12-0123abcd", ".export.old-12-0123abcd"):
        (tmp_path / leftover).mkdir()
        (tmp_path / leftover / "config.json").write_text("crashed")
    (tmp_path / ".export.mine").write_text("not a publish's")
    write_directory_atomically(tmp_path / "export", export_writer("config.json"))
    assert sorted(p.name for p in tmp_path.iterdir()) == [".export.mine", "export"]


# A child process that dies (as under SIGKILL: nothing cleaned up) once its write is durable and before the rename.
CRASH = """
import os, sys
from pathlib import Path
sys.path.insert(0, {repo!r})
os.replace = lambda *args: os._exit(137)
path = Path(sys.argv[1])
if sys.argv[2] == "storage":
    from storage import blobs_for
    blobs_for(path.parent).write(path.name, b"new" * 1000)
elif sys.argv[2] == "directory":
    from preinfer.atomic_write import write_directory_atomically
    write_directory_atomically(path, lambda directory: (directory / "w").write_bytes(b"new" * 1000))
    os._exit(0)  # not killed: nothing was renamed
else:
    from preinfer.atomic_write import write_atomically
    write_atomically(path, b"new" * 1000)
"""


@pytest.mark.parametrize("writer", ["preinfer", "storage"])
@pytest.mark.parametrize("before", [None, b"old"], ids=["absent", "present"])
def test_a_crash_between_write_and_rename_leaves_the_file_whole_or_absent(tmp_path, writer, before):
    path = tmp_path / "file"
    if before is not None:
        path.write_bytes(before)
    child = subprocess.run([sys.executable, "-c", CRASH.format(repo=str(REPO)), str(path), writer],
                           capture_output=True, timeout=120)
    assert child.returncode == 137, child.stderr.decode()[-2000:]
    assert (path.read_bytes() if path.exists() else None) == before
    leftovers = [p for p in tmp_path.iterdir() if p != path]
    assert [p.name.startswith(".file.tmp-") for p in leftovers] == [True]  # hidden, never the file's name
    assert leftovers[0].read_bytes() == b"new" * 1000  # durable before the rename
    if writer == "preinfer":
        write_atomically(path, b"again")  # the next write goes through beside the crash's temporary
        assert path.read_bytes() == b"again"


@pytest.mark.parametrize("before", [None, b"old"], ids=["absent", "present"])
def test_a_crash_before_a_directory_s_renames_leaves_the_previous_one_whole(tmp_path, before):
    """Killed at its first rename (the previous directory moved aside, or the new one put in place): the previous
    directory is at its place as it was (or none is), the new one hidden and whole; the next publish removes it."""
    path = tmp_path / "export"
    if before is not None:
        path.mkdir()
        (path / "w").write_bytes(before)
    child = subprocess.run([sys.executable, "-c", CRASH.format(repo=str(REPO)), str(path), "directory"],
                           capture_output=True, timeout=120)
    assert child.returncode == 137, child.stderr.decode()[-2000:]
    assert ((path / "w").read_bytes() if path.exists() else None) == before
    leftovers = [p for p in tmp_path.iterdir() if p != path]
    assert [p.name.startswith(".export.tmp-") for p in leftovers] == [True]
    assert (leftovers[0] / "w").read_bytes() == b"new" * 1000  # durable before the renames
    write_directory_atomically(path, lambda directory: (directory / "w").write_bytes(b"again"))
    assert [p.name for p in tmp_path.iterdir()] == ["export"] and (path / "w").read_bytes() == b"again"


def test_a_pipelines_gathered_weights_have_the_umask_mode(tmp_path, umask):
    stages = []
    for index in range(2):
        stages.append(tmp_path / f"stage-{index}.safetensors")
        save_file({f"w{index}": TENSORS["w"]}, str(stages[-1]))
    gather_weights(stages, tmp_path / "model.safetensors")
    assert mode(tmp_path / "model.safetensors") == 0o644
    assert set(load_file(str(tmp_path / "model.safetensors"))) == {"w0", "w1"}


@pytest.mark.slow
@pytest.mark.parametrize("umask_value, expected", [(0o022, 0o644), (0o077, 0o600)])
def test_every_file_of_a_run_has_the_umask_mode(tmp_path, corpus, capsys, umask, umask_value, expected):
    """Issue 48 case 14: the export's model.safetensors and the checkpoint's files were 0600 beside 0644 files."""
    umask(umask_value)
    out = tmp_path / "run"
    code, _, err = run_cli(["bcd", "--model", "tiny-llama", "--data", corpus, "--seq-len", "32", "--batch-size", "4",
                            "--steps-per-visit", "1", "--blocks", "2", "--eval-tokens", "64", "--max-samples", "8",
                            "--pre-inference", "off", "--out", str(out)], capsys)
    assert code == 0, err
    modes = {p.relative_to(out).as_posix(): mode(p) for p in out.rglob("*") if p.is_file()}
    assert {"export/model.safetensors", "checkpoint/model.safetensors", "checkpoint/state.safetensors",
            "checkpoint/digest.json", "config.toml", "summary.json"} <= set(modes)
    assert {name: m for name, m in modes.items() if m != expected} == {}
