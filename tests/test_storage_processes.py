"""Stores written by several processes at once, and by a writer killed with SIGKILL (issue 3)."""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from storage import StorageError, create_store, open_store, verify
from storage.errors import IncompleteStoreError

pytestmark = pytest.mark.distributed

ROOT = pathlib.Path(__file__).resolve().parents[1]
FIELDS = {"hidden": ((16, 32), torch.bfloat16), "labels": ((16,), torch.int64)}

# Content of shard i is a pure function of i, so any process can write it and the test can check it.
CHILD_PRELUDE = textwrap.dedent("""
    import sys, time, pathlib, torch
    from storage import open_store

    def content(store, i):
        start, stop = store.shard_range(i)
        gen = torch.Generator().manual_seed(i)
        return {"hidden": torch.randn(stop - start, 16, 32, generator=gen).bfloat16(),
                "labels": torch.arange(start, stop)[:, None].expand(-1, 16).contiguous()}
""")


def child(code: str, *args: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen([sys.executable, "-c", CHILD_PRELUDE + textwrap.dedent(code), *args], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def content(store, i):
    start, stop = store.shard_range(i)
    gen = torch.Generator().manual_seed(i)
    return {"hidden": torch.randn(stop - start, 16, 32, generator=gen).bfloat16(),
            "labels": torch.arange(start, stop)[:, None].expand(-1, 16).contiguous()}


def wait_for(path: pathlib.Path, proc: subprocess.Popen, timeout: float = 240) -> None:
    """Until the child touches `path` (it starts Python and imports torch first: minutes on a loaded machine)."""
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "child never reached the expected point"
        time.sleep(0.02)


def test_two_processes_write_disjoint_shards(tmp_path):
    paths = {backend: str(tmp_path / backend) for backend in ("zarr", "safetensors")}
    stores = {backend: create_store(path, fields=FIELDS, num_samples=50, samples_per_shard=4, fingerprint="fp",
                                    format=backend) for backend, path in paths.items()}
    writer = """
        stores = [open_store(path, expect_fingerprint="fp") for path in sys.argv[2:]]
        for i in range(int(sys.argv[1]), stores[0].num_shards, 2):
            for store in stores:
                store.write_shard(i, content(store, i))
    """
    procs = [child(writer, str(parity), *paths.values()) for parity in (0, 1)]
    for proc in procs:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
    for backend, store in stores.items():
        assert store.missing_shards() == []
        store.finalize()
        reopened = open_store(paths[backend], expect_fingerprint="fp")
        for i in range(reopened.num_shards):
            got, expected = reopened.read_shard(i), content(reopened, i)
            assert torch.equal(got["hidden"].view(torch.int16), expected["hidden"].view(torch.int16))
            assert torch.equal(got["labels"], expected["labels"])
        assert verify(paths[backend]).ok


@pytest.mark.parametrize("backend", ["zarr", "safetensors"])
def test_writer_killed_inside_write_shard(tmp_path, backend):
    path = str(tmp_path / "s")
    store = create_store(path, fields=FIELDS, num_samples=12, samples_per_shard=4, fingerprint="fp", format=backend)
    store.write_shard(0, content(store, 0))
    flag = tmp_path / "inside"
    # The child writes shard 1's data, then hangs inside write_shard before the completion record.
    victim = """
        store = open_store(sys.argv[1])
        real = type(store)._write_data
        def write_then_hang(self, i, tensors):
            files = real(self, i, tensors)
            pathlib.Path(sys.argv[2]).touch()
            time.sleep(600)
            return files
        type(store)._write_data = write_then_hang
        store.write_shard(1, content(store, 1))
    """
    proc = child(victim, path, str(flag))
    wait_for(flag, proc)
    with pytest.raises(StorageError, match=r"'shard-000001' is being written by another process \(pid \d+"):
        store.write_shard(1, content(store, 1))  # a second writer on the same shard
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)

    reopened = open_store(path)
    assert reopened.missing_shards() == [1, 2]
    with pytest.raises(IncompleteStoreError, match=r"shard 1 \(samples 4\.\.8\) is not written yet"):
        reopened.read_shard(1)
    with pytest.raises(IncompleteStoreError):
        reopened.reader(batch_size=2)
    assert verify(path).missing == [1, 2]
    for i in (1, 2):  # the dead writer's lock went with it: writing again just works
        reopened.write_shard(i, content(reopened, i))
    reopened.finalize()
    final = open_store(path)
    assert verify(path).ok
    assert torch.equal(final.read_shard(1)["labels"], content(final, 1)["labels"])
