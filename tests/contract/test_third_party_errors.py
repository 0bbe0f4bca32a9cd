"""Third-party refusals in one line (issue 48, part 2): each case makes a library the project calls refuse for real
(a tracker, s3fs and botocore, zarr, safetensors, tokenizers, transformers, torch.distributed, Dask, pyarrow,
zstandard), through the CLI, and asserts one line naming the component's input (the flag, variable or file) and what
to do, exit code 2, no traceback, and an --out the same command can use afterwards (left absent or empty; for the
rendezvous, the same command then runs). Nothing here reaches the network: the S3 case has no credentials and an
endpoint on 127.0.0.1 that nothing serves."""

from __future__ import annotations

import json
import shutil
import socket
import struct
from pathlib import Path

import pytest

from pipelines.cache import dask_runner
from preinfer.presets import build_preset
from tests.helpers.cli_run import failure_line, run_cli, tree


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("models") / "llama"
    build_preset("tiny-llama").save_pretrained(path)
    return path


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def refused(argv: list[str], out: Path | None, capsys, *named: str) -> str:
    """The one line of a command refused with exit code 2, holding each of `named`; `out` left absent or empty."""
    code, _, err = run_cli(argv, capsys)
    line = failure_line(err)
    assert code == 2, err
    assert all(part in line for part in named), line
    assert out is None or not out.exists() or not any(out.iterdir()), sorted(out.iterdir())
    return line


def bcd(tiny: list[str], corpus: str, out: Path, *extra: str) -> list[str]:
    return ["bcd", *tiny, "--data", corpus, "--out", str(out), *extra]


@pytest.mark.parametrize("uri, says", [
    ("file:{tmp}/mlruns", "maintenance mode"),  # MLflow 3 refuses a file store unless MLFLOW_ALLOW_FILE_STORE
    ("bogus://tracking", "unsupported URI 'bogus://tracking'"),
], ids=["file-store", "unknown-scheme"])
def test_mlflow_refusing_its_tracking_store_is_one_line_naming_the_variable(tiny, corpus, tmp_path, capsys,
                                                                             monkeypatch, uri, says):
    pytest.importorskip("mlflow")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri.format(tmp=tmp_path))
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    out = tmp_path / "run"
    refused(bcd(tiny, corpus, out, "--report-to", "mlflow"), out, capsys, "--report-to mlflow", "MLFLOW_TRACKING_URI",
            says, "sqlite:///", "MLFLOW_ALLOW_FILE_STORE=true")


def test_s3_without_credentials_is_one_line_naming_the_url_and_the_variables(corpus, tmp_path, capsys,
                                                                             monkeypatch):
    pytest.importorskip("s3fs")
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE",
                 "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI", "AWS_CONTAINER_CREDENTIALS_FULL_URI",
                 "AWS_WEB_IDENTITY_TOKEN_FILE", "AWS_ENDPOINT_URL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")  # no instance-metadata lookup: nothing leaves the host
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", f"http://127.0.0.1:{free_port()}")
    url = "s3://preinfer-no-such-bucket/k1"
    refused(["cache", "--model", "tiny-llama", "--data", corpus, "--boundary", "1", "--seq-len", "16", "--out", url,
             "--quiet"], None, capsys, url, "no usable AWS credentials", "AWS_ACCESS_KEY_ID")
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("s3")]


def zarr_2_array(field: Path) -> None:
    """The field's array replaced by one zarr 2 writes (`.zarray`), of the same shape and dtype."""
    import zarr

    shape, dtype = json.loads((field / "zarr.json").read_text())["shape"], "float32"
    shutil.rmtree(field)
    zarr.create_array(store=str(field.parent), name=field.name, shape=shape, dtype=dtype, chunks=shape,
                      zarr_format=2)


def unknown_codec(field: Path) -> None:
    """The field's zarr.json naming a codec no installed zarr or numcodecs has (a newer version's)."""
    metadata = json.loads((field / "zarr.json").read_text())
    metadata["codecs"][0]["configuration"]["codecs"][-1]["name"] = "zstd-from-the-future"
    (field / "zarr.json").write_text(json.dumps(metadata))


@pytest.mark.parametrize("change, says", [
    (zarr_2_array, "is in zarr format 2"),
    (unknown_codec, "names a codec this zarr"),
], ids=["zarr-2-array", "unknown-codec"])
def test_a_zarr_store_of_another_version_is_one_line_naming_the_array(cache, tmp_path, capsys, change, says):
    store = tmp_path / "cache"
    shutil.copytree(cache, store)
    change(store / "train" / "data" / "hidden")
    before = tree(store)
    refused(["inspect", str(store)], None, capsys, f"store {store}/train", "field 'hidden'", says,
            "preinfer cache --overwrite")
    assert tree(store) == before


def header_not_json(weights: Path) -> None:
    """A safetensors file whose header length is right and whose header is not JSON."""
    data = bytearray(weights.read_bytes())
    (length,) = struct.unpack("<Q", data[:8])
    data[8:8 + length] = b"{" + b" " * (length - 1)
    weights.write_bytes(bytes(data))


def broken_tokenizer(directory: Path) -> None:
    """A tokenizer directory whose tokenizer.json tokenizers cannot parse (cut mid-object)."""
    directory.mkdir()
    (directory / "tokenizer.json").write_text('{"version": "1.0", "model": {"type": "BPE"')
    (directory / "tokenizer_config.json").write_text("{}")


def test_a_safetensors_header_that_is_not_json_is_one_line_naming_the_model(llama, corpus, tmp_path, capsys):
    model = tmp_path / "model"
    shutil.copytree(llama, model)
    header_not_json(model / "model.safetensors")
    out = tmp_path / "cache"
    refused(["cache", "--model", str(model), "--data", corpus, "--boundary", "1", "--seq-len", "16", "--out",
             str(out), "--quiet"], out, capsys, str(model), "safetensors", "invalid JSON in header")


def test_a_tokenizer_json_tokenizers_cannot_parse_is_one_line_naming_the_directory(tiny, corpus, tmp_path, capsys):
    broken_tokenizer(tmp_path / "tokenizer")
    out = tmp_path / "run"
    refused(bcd(tiny, corpus, out, "--tokenizer", str(tmp_path / "tokenizer")), out, capsys,
            "no usable tokenizer in directory", str(tmp_path / "tokenizer"))


def test_a_config_json_of_a_model_type_transformers_lacks_is_one_line(llama, tiny, corpus, tmp_path, capsys):
    model = tmp_path / "model"
    shutil.copytree(llama, model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "model_type": "no-such-architecture"}))
    out = tmp_path / "run"
    refused(bcd(tiny, corpus, out, "--model", str(model)), out, capsys, f"cannot read a model config from "
            f"'{model}'", "no-such-architecture", "pip install --upgrade transformers")


def test_a_rendezvous_on_a_taken_port_is_one_line_then_the_same_command_runs(tiny, corpus, tmp_path, capsys,
                                                                              monkeypatch):
    out = tmp_path / "run"
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with monkeypatch.context() as env:
            for name, value in {"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                                "MASTER_PORT": str(port)}.items():
                env.setenv(name, value)
            refused(bcd(tiny, corpus, out), out, capsys, f"MASTER_ADDR:MASTER_PORT 127.0.0.1:{port}",
                    "EADDRINUSE", "torchrun")
    code, _, err = run_cli(bcd(tiny, corpus, out), capsys)
    assert code == 0, err


def test_a_dask_scheduler_that_does_not_answer_is_one_line_before_any_store_is_made(corpus, tmp_path, capsys,
                                                                                    monkeypatch):
    pytest.importorskip("distributed")
    monkeypatch.setattr(dask_runner, "CONNECT_TIMEOUT", "1s")
    address = f"tcp://127.0.0.1:{free_port()}"
    out = tmp_path / "cache"
    refused(["cache", "--model", "tiny-llama", "--data", corpus, "--boundary", "1", "--seq-len", "16", "--out",
             str(out), "--quiet", "--dask", address], out, capsys, f"--dask {address}",
            "cannot reach the Dask scheduler", "start it")


@pytest.mark.parametrize("name, content, says", [
    ("corpus.parquet", b"PAR1 not a parquet file PAR1", "not a readable Parquet file"),  # pyarrow
    ("corpus.txt.zst", b"not zstandard data", "ZstdError"),  # zstandard
], ids=["pyarrow", "zstandard"])
def test_a_data_file_its_reader_refuses_is_one_line_naming_the_file(tiny, tmp_path, capsys, name, content, says):
    data = tmp_path / name
    data.write_bytes(content)
    out = tmp_path / "run"
    refused(bcd(tiny, str(data), out), out, capsys, str(data), says)
