"""`preinfer inspect` and `preinfer verify` on caches made by the caching job."""

import json

import pytest

from tests.helpers.cache_jobs import SEQ, cache, staged_model, stored_datasets
from tests.helpers.cli_run import run_cli
from tests.helpers.corpus_samples import write_corpus


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """(corpus, cache directory) of tiny-llama at boundary 2, float32, zarr."""
    root = tmp_path_factory.mktemp("inspect")
    corpus = write_corpus(root / "corpus.txt")
    cache(staged_model(), stored_datasets(corpus), 2, root / "c")
    return corpus, root / "c"


def test_inspect_shows_the_manifest_in_human_terms(made, capsys):
    _, out = made
    code, stdout, err = run_cli(["inspect", str(out)], capsys)
    assert code == 0, err
    for text in ("train: ", "eval: ", "status        complete", "samples       ", f"of {SEQ} tokens",
                 "tokens        ", "real", "hidden [32, 64] float32", "attention_mask [32] bool",
                 "position_ids [32] int64", "labels [32] int64", "raw", "stored", "on disk", "compression ",
                 "fingerprint   ", "prefix", "boundary    2", "dataset", "tokenizer", "seq_len     32",
                 "dtype       float32", "model       tiny-llama", "blosc-zstd"):
        assert text in stdout, text
    code, stdout, _ = run_cli(["inspect", str(out / "train"), "--json"], capsys)
    info = json.loads(stdout)
    assert code == 0 and info["complete_shards"] == info["shards"] and info["finalized"]
    assert info["samples"] * SEQ == info["tokens"] and 0 < info["real_tokens"] <= info["tokens"]
    assert info["compression_ratio"] > 1 and info["disk_bytes"] >= info["stored_bytes"] > 0
    assert info["fingerprint"]["parts"]["boundary"] == 2


def test_inspect_shows_an_incomplete_store(made, tmp_path, capsys):
    import shutil

    _, out = made
    shutil.copytree(out / "train", tmp_path / "train")
    manifest = json.loads((tmp_path / "train" / "manifest.json").read_text())
    (tmp_path / "train" / "done").mkdir()  # what a killed job leaves: completion records, shard 1's missing
    for i, record in manifest["shards"].items():
        if i != "1":
            (tmp_path / "train" / "done" / f"shard-{int(i):06d}.json").write_text(json.dumps(record))
    manifest["complete"], manifest["shards"] = False, {}
    (tmp_path / "train" / "manifest.json").write_text(json.dumps(manifest))
    code, stdout, _ = run_cli(["inspect", str(tmp_path / "train")], capsys)
    assert code == 0 and "INCOMPLETE: 1 of" in stdout
    code, stdout, _ = run_cli(["verify", str(tmp_path / "train")], capsys)
    assert code == 1 and "not written: shards 1" in stdout


def test_inspect_of_nothing_is_an_error(tmp_path, capsys):
    code, _, err = run_cli(["inspect", str(tmp_path)], capsys)
    assert code == 1 and "no activation store" in err


def test_verify_checks_integrity_and_recomputes_samples(made, capsys):
    corpus, out = made
    code, stdout, err = run_cli(["verify", str(out)], capsys)
    assert code == 0 and "verify: OK" in stdout, stdout + err
    code, stdout, err = run_cli(["verify", str(out), "--model", "tiny-llama", "--data", corpus, "--sample", "5"],
                                capsys)
    assert code == 0, stdout + err
    assert stdout.count("recomputed 5 samples") == 2 and "MISMATCH" not in stdout and "verify: OK" in stdout
    # another model: the fingerprint is stale and the recomputed samples differ
    code, stdout, _ = run_cli(["verify", str(out), "--model", "tiny-llama", "--model-seed", "1", "--data", corpus,
                               "--sample", "2"], capsys)
    assert code == 1 and "STALE" in stdout and "prefix: store has" in stdout and "MISMATCH" in stdout


def test_verify_names_a_damaged_shard(made, tmp_path, capsys):
    import shutil

    _, out = made
    shutil.copytree(out, tmp_path / "c")
    chunk = next(p for p in sorted((tmp_path / "c" / "eval" / "data" / "hidden").rglob("*"))
                 if p.is_file() and p.name != "zarr.json")
    data = bytearray(chunk.read_bytes())
    data[len(data) // 2] ^= 0xFF
    chunk.write_bytes(bytes(data))
    code, stdout, _ = run_cli(["verify", str(tmp_path / "c")], capsys)
    assert code == 1 and "eval: store" in stdout and "BAD" in stdout and "shard 0" in stdout
    assert "verify: FAILED (eval)" in stdout


def test_verify_data_without_model_is_a_usage_error(made, capsys):
    corpus, out = made
    code, _, err = run_cli(["verify", str(out), "--data", corpus], capsys)
    assert code == 2 and "--model" in err
