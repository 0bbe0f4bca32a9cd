"""What the contract tests share: the tiny run's flags, a finished tiny run, a small cache and a BERT; for the
write-fault tests a tmpfs and the uninterrupted runs they are held to."""

from pathlib import Path

import pytest
from transformers import BertConfig, BertModel

from pipelines.cli import main
from tests.helpers.disk_faults import FailingWrites, Tmpfs
from tests.helpers.write_faults import RUNS, Reference, bcd_args, run_main, run_result

TINY = ["--model", "tiny-llama", "--seq-len", "32", "--batch-size", "4", "--steps-per-visit", "2",
        "--eval-tokens", "64", "--lr", "1e-3", "--blocks", "2", "--pre-inference", "off"]


@pytest.fixture(scope="module")
def tiny() -> list[str]:
    """Flags of a tiny bcd run (2 blocks of tiny-llama, 2 steps each, prefix live); add --data and --out."""
    return list(TINY)


@pytest.fixture(scope="module")
def finished(corpus, tmp_path_factory) -> tuple[Path, list[str]]:
    """A finished tiny bcd run and the command that made it (its last argument is the run directory)."""
    out = tmp_path_factory.mktemp("finished") / "run"
    argv = ["bcd", *TINY, "--data", corpus, "--out", str(out)]
    assert main(argv) == 0
    return out, argv


@pytest.fixture(scope="module")
def cache(corpus, tmp_path_factory) -> Path:
    """A cache of tiny-llama at boundary 2 (train and eval splits, shards of 8 samples), made by `preinfer cache`."""
    out = tmp_path_factory.mktemp("cache") / "c"
    assert main(["cache", "--model", "tiny-llama", "--data", corpus, "--boundary", "2", "--out", str(out),
                 "--seq-len", "32", "--samples-per-shard", "8", "--quiet"]) == 0
    return out


@pytest.fixture(scope="module")
def bert(tmp_path_factory) -> Path:
    """A saved BERT: a model directory of an architecture preinfer cannot stage."""
    path = tmp_path_factory.mktemp("bert") / "bert"
    BertModel(BertConfig(vocab_size=258, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                         intermediate_size=64)).save_pretrained(path)
    return path


@pytest.fixture
def tmpfs(tmp_path):
    """A tmpfs at tmp_path/disk, unmounted after the test; skipped only where mounting is refused (not root)."""
    try:
        disk = Tmpfs(tmp_path / "disk")
    except PermissionError as err:
        pytest.skip(f"a real full or read-only disk needs a tmpfs mount, refused here: {err}")
    yield disk
    disk.unmount()


@pytest.fixture(scope="module")
def run_tokens(tmp_path_factory) -> Path:
    """The module's --token-store: written by the first reference run, found complete by every later run."""
    return tmp_path_factory.mktemp("tokens")


@pytest.fixture(scope="module")
def uninterrupted_runs(tmp_path_factory, corpus, run_tokens) -> dict[str, Reference]:
    """Each run uninterrupted (the second of two, the first having written the token store)."""
    root = tmp_path_factory.mktemp("reference")
    found = {}
    with pytest.MonkeyPatch.context() as patch:
        for run in RUNS:
            for attempt in ("tokens", "counted"):
                out = root / f"{run}-{attempt}"
                writes = FailingWrites(patch, under=out)
                assert run_main(bcd_args(corpus, run_tokens, out, run)) == 0
            found[run] = Reference(run_result(out), [path.relative_to(out).as_posix() for path in writes.paths])
    return found
