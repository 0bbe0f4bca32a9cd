"""Stores on S3, against a local S3 server (moto in server mode on 127.0.0.1) that this module starts: the caching
job writes s3:// (killed with SIGKILL and resumed), `train --store`, `inspect` and `verify` read it, the objects
are the bytes of a local-disk store of the same job, and nothing is written locally."""

import json
import logging
import socket
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from moto.server import ThreadedMotoServer
from safetensors.torch import load_file

from preinfer.run_dir import RunDir
from pipelines.cache.dask_runner import shutdown_local_clusters
from storage import create_store, location, open_store
from storage.errors import UnsupportedLocationError
from tests.helpers.cache_jobs import BATCH, PER_SHARD, SEQ, cache, datasets_for, staged_model
from tests.helpers.cli_run import run_cli
from tests.helpers.corpus_samples import write_corpus
from tests.helpers.slow_cache import REPO, kill_once, start_slow_cache

BUCKET = "preinfer-test"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def s3():
    """A moto S3 server on 127.0.0.1 with one bucket, and fake credentials and its endpoint in the environment
    (which subprocesses and Dask workers inherit)."""
    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # no line per request
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    with pytest.MonkeyPatch.context() as env:
        fake = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
                "AWS_ENDPOINT_URL_S3": f"http://127.0.0.1:{port}"}
        for name, value in fake.items():
            env.setenv(name, value)
        env.delenv("AWS_ENDPOINT_URL", raising=False)
        env.delenv("AWS_PROFILE", raising=False)
        fs = location(f"s3://{BUCKET}/x").fs
        fs.mkdir(BUCKET)
        yield fs
    server.stop()


def cache_args(corpus: str, out: str, *extra: str) -> list[str]:
    return ["cache", "--model", "tiny-llama", "--data", corpus, "--seq-len", str(SEQ), "--boundary", "2", "--out",
            out, "--samples-per-shard", str(PER_SHARD), "--batch-size", str(BATCH), "--quiet", *extra]


def objects(fs, prefix: str) -> dict[str, bytes]:
    """{key relative to `prefix`: bytes} of every object under s3://`prefix`."""
    return {key[len(prefix) + 1:]: fs.cat_file(key) for key in fs.find(prefix)}


def files(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def without_creation_time(manifest: bytes) -> dict:
    parsed = json.loads(manifest)
    parsed.pop("created")
    return parsed


def assert_same_bytes(fs, prefix: str, local: Path) -> None:
    """The objects under s3://`prefix` are the files of `local`, byte for byte (manifests: but their time)."""
    stored, expected = objects(fs, prefix), files(local)
    assert sorted(stored) == sorted(expected)
    for key, data in expected.items():
        if key.endswith("manifest.json"):
            assert without_creation_time(stored[key]) == without_creation_time(data), key
        else:
            assert stored[key] == data, key


def assert_nothing_local(*directories: Path) -> None:
    for directory in (*directories, Path(tempfile.gettempdir())):
        assert not [p for p in directory.iterdir() if p.name.startswith("s3:")], directory


@pytest.mark.distributed
def test_cache_killed_and_resumed_on_s3_equals_a_local_store_and_trains(s3, workdir, tmp_path, capsys):
    corpus = write_corpus(tmp_path / "corpus.txt")
    url = f"s3://{BUCKET}/k2"
    args = cache_args(corpus, url)
    proc = start_slow_cache(args, workdir)
    done = f"{BUCKET}/k2/train/done"
    kill_once(proc, lambda: s3.exists(done) and len(s3.ls(done)) >= 3)
    store = open_store(f"{url}/train", check_files=False)
    finished = len(store.completed_shards())
    assert 3 <= finished < store.num_shards and not store.manifest["complete"]

    code, stdout, err = run_cli(args, capsys)  # the same command resumes it
    assert code == 0, err
    assert f"{finished} already done" in stdout and url in stdout
    assert run_cli(cache_args(corpus, str(tmp_path / "local")), capsys)[0] == 0
    assert_same_bytes(s3, f"{BUCKET}/k2", tmp_path / "local")

    code, stdout, err = run_cli(["inspect", url], capsys)
    assert code == 0 and f"{url}/train" in stdout and f"{url}/eval" in stdout, err
    code, stdout, err = run_cli(["verify", url], capsys)
    assert code == 0 and "verify: OK" in stdout, err
    train = ["train", "--model", "tiny-llama", "--batch-size", "4", "--steps-per-visit", "3", "--blocks", "2",
             "--seed", "0"]
    for name, store_path in (("from_s3", url), ("from_disk", str(tmp_path / "local"))):
        code, _, err = run_cli([*train, "--store", store_path, "--out", str(tmp_path / name)], capsys)
        assert code == 0, err
    trained = [load_file(str(RunDir(str(tmp_path / name)).checkpoint_weights)) for name in ("from_s3", "from_disk")]
    assert trained[0].keys() == trained[1].keys()
    assert all(torch.equal(trained[0][k], trained[1][k]) for k in trained[0])
    assert_nothing_local(workdir, tmp_path, REPO)


@pytest.mark.distributed
def test_dask_workers_write_the_store_from_its_url(s3, workdir, tmp_path):
    corpus = write_corpus(tmp_path / "corpus.txt", paragraphs=10)
    datasets = datasets_for(corpus)
    cache(staged_model(), datasets, 2, tmp_path / "local")
    try:
        result = cache(staged_model(), datasets, 2, f"s3://{BUCKET}/dask", dask="local:1")
    finally:
        shutdown_local_clusters()
    assert result.model_loads and result.shards_computed > 1  # the worker computed and wrote the shards
    assert str(result.path) == f"s3://{BUCKET}/dask"
    assert_same_bytes(s3, f"{BUCKET}/dask", tmp_path / "local")
    assert_nothing_local(workdir, tmp_path)


@pytest.mark.slow
def test_a_shard_whose_completion_record_was_never_put_is_not_complete(s3, monkeypatch):
    fields = {"hidden": ((4,), torch.float32)}
    url = f"s3://{BUCKET}/half"
    store = create_store(url, fields, num_samples=8, samples_per_shard=4, fingerprint="fp")
    blobs = store._blobs
    real_write = type(blobs).write

    def die_before_the_record(self, key, data):
        if key.startswith("done/"):
            raise KeyboardInterrupt("killed between the data PUT and the completion record")
        real_write(self, key, data)

    monkeypatch.setattr(type(blobs), "write", die_before_the_record)
    with pytest.raises(KeyboardInterrupt):
        store.write_shard(0, {"hidden": torch.ones(4, 4)})
    monkeypatch.undo()
    assert [k for k in s3.find(f"{BUCKET}/half/data") if "/c/" in k]  # the shard's data object is in the bucket
    reopened = open_store(url, check_files=False)
    assert reopened.missing_shards() == [0, 1]
    for i in (0, 1):
        reopened.write_shard(i, {"hidden": torch.full((4, 4), float(i))})
    reopened.finalize()
    assert torch.equal(open_store(url).read_shard(0)["hidden"], torch.zeros(4, 4))
    assert not s3.exists(f"{BUCKET}/half/done")


def test_s3_without_s3fs_names_the_extra(monkeypatch, workdir, capsys):
    monkeypatch.setitem(sys.modules, "s3fs", None)  # import s3fs fails
    with pytest.raises(UnsupportedLocationError, match=r"pip install 'preinfer\[s3\]'"):
        location("s3://bucket/k2")
    code, _, err = run_cli(cache_args("builtin:pydoc", "s3://bucket/k2"), capsys)
    assert code == 2 and err.count("\n") == 1 and "pip install 'preinfer[s3]'" in err and "--out" in err
    assert not list(workdir.iterdir())

