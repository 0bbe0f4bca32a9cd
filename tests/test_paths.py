"""Every flag that names a store or output location: URLs flow as URLs (memory:// here, s3:// in test_s3.py), and
a scheme stores cannot be written to is refused with exit 2 and one line, never turned into a local directory."""

import uuid
from pathlib import Path

import pytest

from preinfer.metrics import CacheRecord, read_metrics
from preinfer.run_dir import RunDir
from storage import is_store, location, open_store
from tests.helpers.cache_jobs import BATCH, PER_SHARD, SEQ
from tests.helpers.cli_run import run_cli
from tests.helpers.corpus_samples import write_corpus

# Each flag that takes a store (or a directory of stores), as the argv of a command with LOCATION in its place.
STORE_FLAGS = {
    "cache --out": ["cache", "--model", "tiny-llama", "--boundary", "1", "--out", "LOCATION"],
    "cache --from-store": ["cache", "--model", "tiny-llama", "--boundary", "2", "--out", "c", "--from-store",
                           "LOCATION"],
    "inspect STORE": ["inspect", "LOCATION"],
    "verify STORE": ["verify", "LOCATION"],
    "train --store": ["train", "--model", "tiny-llama", "--store", "LOCATION"],
    "bcd --store-dir": ["bcd", "--model", "tiny-llama", "--store-dir", "LOCATION"],
}
# Each flag that takes a run directory: local only (checkpoints and metrics), so every URL is refused.
RUN_FLAGS = {
    "train --out": ["train", "--model", "tiny-llama", "--store", "c", "--out", "LOCATION"],
    "bcd --out": ["bcd", "--model", "tiny-llama", "--out", "LOCATION"],
    "demo --out": ["demo", "--out", "LOCATION"],
}
UNWRITABLE = ["ftp://host/stores/k2", "gs://bucket/k2", "http://host/k2"]


def argv(template: list[str], where: str) -> list[str]:
    return [where if part == "LOCATION" else part for part in template]


def assert_refused(flag: str, where: str, code, err: str, workdir) -> None:
    assert code == 2, err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert flag.split()[1] in err and where in err
    assert not list(workdir.iterdir()), "a local directory was created"


@pytest.mark.parametrize("where", UNWRITABLE)
@pytest.mark.parametrize("flag", sorted(STORE_FLAGS))
def test_a_store_flag_refuses_a_scheme_it_cannot_write(flag, where, workdir, capsys):
    code, _, err = run_cli(argv(STORE_FLAGS[flag], where), capsys)
    assert_refused(flag, where, code, err, workdir)
    assert f"{where.split(':')[0]}://" in err and "s3://" in err  # what it got, and what it takes


@pytest.mark.parametrize("where", [*UNWRITABLE, "s3://bucket/run", "memory://run"])
@pytest.mark.parametrize("flag", sorted(RUN_FLAGS))
def test_a_run_directory_flag_refuses_every_url(flag, where, workdir, capsys):
    code, _, err = run_cli(argv(RUN_FLAGS[flag], where), capsys)
    assert_refused(flag, where, code, err, workdir)
    assert "local path" in err


@pytest.mark.parametrize("section, key, where", [("run", "out", "s3://bucket/run"),
                                                 ("store", "path", "ftp://host/k2"),
                                                 ("pre_inference", "store_dir", "gs://bucket/stores")])
def test_a_config_file_location_is_checked_like_its_flag(section, key, where, tmp_path, workdir, capsys):
    config = tmp_path / "run.toml"
    config.write_text(f'[{section}]\n{key} = "{where}"\n')
    command = "bcd" if section == "pre_inference" else "train"
    extra = ["--store", "c"] if section == "run" else []
    code, _, err = run_cli([command, "--model", "tiny-llama", "--config", str(config), *extra], capsys)
    assert code == 2 and err.count("\n") == 1 and f"[{section}] {key}" in err and where in err, err
    assert not list(workdir.iterdir())


def test_file_urls_and_local_paths_stay_local(tmp_path):
    assert location(f"file://{tmp_path}/a") == tmp_path / "a"
    assert location("relative/dir") == Path("relative/dir")
    assert str(location("memory://x/y/")) == "memory://x/y"
    assert location("memory://x/y").parent == location("memory://x") and location("memory://x/y").name == "y"


@pytest.mark.slow
def test_every_store_flag_takes_a_url(tmp_path, workdir, capsys):
    """memory:// (fsspec's in-process filesystem) through cache --out, --from-store, inspect, verify,
    train --store and bcd --store-dir: the stores land behind the URL, nothing in the working directory."""
    corpus = write_corpus(tmp_path / "corpus.txt", paragraphs=12)
    root = f"memory://paths-{uuid.uuid4().hex[:8]}"
    common = ["--model", "tiny-llama", "--data", corpus, "--seq-len", str(SEQ), "--samples-per-shard", str(PER_SHARD),
              "--batch-size", str(BATCH), "--quiet"]
    assert run_cli(["cache", *common, "--boundary", "1", "--out", f"{root}/k1"], capsys)[0] == 0
    code, _, err = run_cli(["cache", *common, "--boundary", "2", "--out", f"{root}/k2", "--from-store", f"{root}/k1"],
                           capsys)
    assert code == 0, err
    assert is_store(f"{root}/k2/train") and open_store(f"{root}/k2/train").fingerprint.parts["boundary"] == 2
    code, out, err = run_cli(["inspect", f"{root}/k2"], capsys)
    assert code == 0 and f"{root}/k2/train" in out, err
    code, out, err = run_cli(["verify", f"{root}/k2"], capsys)
    assert code == 0 and "verify: OK" in out, err
    training = ["--model", "tiny-llama", "--batch-size", "4", "--steps-per-visit", "2", "--blocks", "2", "--seed", "0"]
    code, _, err = run_cli(["train", *training, "--store", f"{root}/k2", "--out", str(tmp_path / "t")], capsys)
    assert code == 0, err
    run = tmp_path / "b"
    code, _, err = run_cli(["bcd", *training, "--data", corpus, "--seq-len", str(SEQ), "--pre-inference", "on",
                            "--store-dir", f"{root}/stores", "--keep-stores", "--out", str(run)], capsys)
    assert code == 0, err
    built = [r for r in read_metrics(RunDir(str(run)).metrics) if isinstance(r, CacheRecord) and r.how == "input"]
    assert built and all(is_store(f"{root}/stores/boundary-{r.boundary}/train") for r in built)
    assert not (run / "stores").exists() and not list(workdir.iterdir())
