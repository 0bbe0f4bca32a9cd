"""Test-wide settings: one intra-op thread (the tests' tensors are tiny; on a busy 2-core machine more threads
only contend), inherited by the subprocesses the tests start; the corpora, one fixture per purpose."""

import os

import pytest
import torch

from tests.helpers.corpus_samples import paragraphs_corpus, write_corpus
from tests.helpers.pinned_rates import PINNED, pin_rates

os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def one_thread():
    """Every test starts on one intra-op thread, whatever a test before it in the same worker set: the float32 sums
    of the tests that compare runs bit for bit, or within 1e-5, follow the thread count."""
    torch.set_num_threads(1)


@pytest.fixture(scope="session", autouse=True)
def token_store_cache(tmp_path_factory):
    """Jobs tokenise corpora into a cache of this session's own (never the user's ~/.cache), shared by its tests
    and the commands they start."""
    os.environ["XDG_CACHE_HOME"] = str(tmp_path_factory.mktemp("xdg-cache"))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
    """A small text corpus: 24 paragraphs, enough for a few dozen samples of 32 tokens in each split."""
    return paragraphs_corpus(tmp_path_factory.mktemp("data") / "corpus.txt")


@pytest.fixture(scope="module")
def cache_corpus(tmp_path_factory) -> str:
    """The caching job's corpus: 60 paragraphs, ~200 samples of 32 tokens in train, several shards of each split."""
    return write_corpus(tmp_path_factory.mktemp("data") / "corpus.txt")


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    """An empty working directory for the commands, to see that none of them writes a local `s3:` directory."""
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    return work


@pytest.fixture
def pinned_rates(monkeypatch):
    """Pre-inference plans with `pinned_rates.PINNED` wherever it would measure a throughput (for tests that assert
    which visits read a store or how a store is made: those choices follow the measured speeds)."""
    pin_rates(monkeypatch.setattr)
    return PINNED
