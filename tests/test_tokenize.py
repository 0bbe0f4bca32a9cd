"""The token store and the streaming readers: compressed and Parquet inputs, exact decoding against `load_data`,
identical bytes across reruns, worker counts and a SIGKILL, lazy reads, and one-line errors for bad input."""

from __future__ import annotations

import gzip
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import zstandard

import pipelines.data.corpus as corpus
import storage
from pipelines.cli import main
from pipelines.data.token_store import TokenizeOptions, TokenStoreDataset, cache_path, token_fingerprint, tokenize_corpus
from pipelines.data.token_store.layout import store_fields
from pipelines.data.token_store.staging import Staging
from pipelines.data.corpus import corpus_fingerprint, read_documents
from pipelines.data.samples import id_dtype
from pipelines.data.in_memory import load_data
from preinfer.errors import UsageError
from pipelines.data.tokenizers import load_tokenizer
from tests.helpers.corpus_samples import (
    CASES, instruction_records, jsonl_text, text_corpus, text_records, write_corpora,
)
from tests.helpers.one_line_errors import raises_one_line
from tests.helpers.word_tokenizer import CORPUS, save_word_tokenizer

REPO = Path(__file__).resolve().parents[1]
BYTE = load_tokenizer("byte")
SPLITS = ("train", "eval")


def build(data, out, **options) -> TokenStoreDataset:
    """Tokenise `data` into a token store at `out` (small chunks and shards, to cross their ends) and open train."""
    settings = dict(seq_len=16, eval_fraction=0.2, chunk_chars=300, samples_per_shard=5, progress=False)
    tokenize_corpus(TokenizeOptions(data=str(data), out=str(out), **{**settings, **options}))
    return TokenStoreDataset(out, "train")


def assert_same_samples(store_root: Path, reference: dict[str, object]) -> None:
    """Every split of the token store decodes to the tensors of the in-memory dataset, whole and by index."""
    for split, data in reference.items():
        lazy = TokenStoreDataset(store_root, split)
        assert len(lazy) == len(data) and lazy.seq_len == data.seq_len and lazy.num_tokens == data.num_tokens
        order = torch.randperm(len(data), generator=torch.Generator().manual_seed(0))
        for index in (slice(None), order, order[:3].tolist(), -1, torch.tensor(2)):
            got, want = lazy[index], data[index]
            for key in want:
                assert got[key].dtype == want[key].dtype and torch.equal(got[key], want[key]), (split, key, index)


def tree(root: Path) -> dict[str, bytes]:
    """Every file under `root` by relative path, but for what names the time or the process that wrote it: the
    manifests' creation time and storage's writer locks (which hold a pid)."""
    files = {}
    for path in sorted(root.rglob("*")):
        if path.is_file() and path.parent.name != "locks":
            data = path.read_bytes()
            if path.name == "manifest.json":
                manifest = json.loads(data)
                manifest.pop("created")
                data = json.dumps(manifest, sort_keys=True).encode()
            files[path.relative_to(root).as_posix()] = data
    return files


def cli(argv: list[str], capsys) -> tuple[int, str, str]:
    code = main(argv)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


# ---- exact samples ----


@pytest.mark.parametrize("name,seq_len,eval_fraction", CASES)
def test_token_store_decodes_to_the_samples_of_load_data(tmp_path, name, seq_len, eval_fraction):
    path = str(write_corpora(tmp_path / "corpora")[name])
    build(path, tmp_path / "tokens", seq_len=seq_len, eval_fraction=eval_fraction)
    assert_same_samples(tmp_path / "tokens", {s: load_data(path, BYTE, seq_len, s, eval_fraction) for s in SPLITS})


def test_pydoc_and_an_hf_tokenizer(tmp_path):
    reference = {split: load_data("builtin:pydoc", BYTE, 64, split) for split in SPLITS}
    build("builtin:pydoc", tmp_path / "pydoc", seq_len=64, eval_fraction=0.1, chunk_chars=20_000, samples_per_shard=97)
    assert_same_samples(tmp_path / "pydoc", reference)

    words = save_word_tokenizer(tmp_path / "tok", CORPUS + [text_corpus(5)])
    hf = load_tokenizer(str(words))
    text = tmp_path / "t.txt"
    text.write_text(text_corpus(60), encoding="utf-8")
    build(text, tmp_path / "hf", tokenizer=str(words), seq_len=6)
    info = TokenStoreDataset(tmp_path / "hf", "train").info
    assert info.id_dtype == "uint8" and info.vocab_size == hf.vocab_size <= 256
    assert_same_samples(tmp_path / "hf", {s: load_data(str(text), hf, 6, s, 0.2) for s in SPLITS})


def test_encode_batch_gives_the_ids_of_encode(tmp_path):
    texts = ["", "the cat sat on the mat", text_corpus(3), "日本 ✓"]
    hf = load_tokenizer(str(save_word_tokenizer(tmp_path / "tok", CORPUS)))
    for tokenizer in (BYTE, hf):
        assert [ids.tolist() for ids in tokenizer.encode_batch(texts)] == [tokenizer.encode(t) for t in texts]


@pytest.mark.parametrize("vocab_size,dtype", [(256, "uint8"), (258, "uint16"), (65536, "uint16"), (65537, "int32")])
def test_ids_are_stored_in_the_smallest_dtype_of_the_vocabulary_and_read_back_exactly(vocab_size, dtype, tmp_path):
    assert id_dtype(vocab_size) == np.dtype(dtype)
    ids = np.random.default_rng(0).integers(0, vocab_size, (6, 5)).astype(dtype)
    ids[0, :2] = [0, vocab_size - 1]
    fields = store_fields("lm", 5, np.dtype(dtype))
    store = storage.create_store(tmp_path / "ids", fields, 6, 4, storage.Fingerprint("f", {}))
    for shard in store.missing_shards():
        start, stop = store.shard_range(shard)
        store.write_shard(shard, {"ids": torch.from_numpy(ids[start:stop])})
    store.finalize()
    stored = storage.open_store(tmp_path / "ids")
    assert stored.fields["ids"].dtype == dtype
    assert np.array_equal(np.concatenate([stored.read_shard(i)["ids"].numpy() for i in range(2)]), ids)


# ---- inputs ----


def compressed(path: Path, suffix: str) -> Path:
    """A copy of `path` compressed by `suffix` (.gz or .zst)."""
    target = path.with_name(path.name + suffix)
    data = path.read_bytes()
    target.write_bytes(gzip.compress(data) if suffix == ".gz" else zstandard.ZstdCompressor().compress(data))
    return target


def write_parquet(path: Path, records: list[dict], row_group_size: int = 16) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    columns = sorted({key for record in records for key in record})
    table = pa.table({key: [record.get(key) for record in records] for key in columns})
    pq.write_table(table, path, row_group_size=row_group_size)
    return path


def test_compressed_and_parquet_inputs_give_the_samples_of_plain_jsonl(tmp_path):
    records = {"text": text_records(120), "instruction": instruction_records(40)}
    for kind, rows in records.items():
        plain = tmp_path / f"{kind}.jsonl"
        plain.write_text(jsonl_text(rows, blank_every=9), encoding="utf-8")
        parquet = write_parquet(tmp_path / f"{kind}.parquet", rows)
        sources = [compressed(plain, ".gz"), compressed(plain, ".zst"), parquet]
        seq_len = 24 if kind == "text" else 200
        reference = load_data(str(plain), BYTE, seq_len, "train", 0.2)
        for source in sources:
            assert read_documents(str(source)) == read_documents(str(plain)), source
            data = load_data(str(source), BYTE, seq_len, "train", 0.2)
            assert torch.equal(data.input_ids, reference.input_ids) and torch.equal(data.labels, reference.labels)
        lazy = build(sources[1], tmp_path / f"{kind}-zst", seq_len=seq_len)
        assert torch.equal(lazy[:]["labels"], reference.labels)
    text = tmp_path / "c.txt"
    text.write_text(text_corpus(50), encoding="utf-8")
    for suffix in (".gz", ".zst"):
        assert read_documents(str(compressed(text, suffix))) == read_documents(str(text))


def test_parquet_text_column_and_nulls(tmp_path):
    path = write_parquet(tmp_path / "t.parquet", [{"body": f"row {i}", "id": i} for i in range(40)])
    assert read_documents(str(path), text_column="body") == [f"row {i}" for i in range(40)]
    with raises_one_line(r"t\.parquet: row 1: record has neither a 'text' field .* its fields are \['body', 'id'\]"):
        read_documents(str(path))
    with raises_one_line(r"t\.parquet: row 1: field 'id' must be a string, got int"):
        read_documents(str(path), text_column="id")
    write_parquet(path, [{"text": "fine"}] * 20 + [{"text": None}])
    with raises_one_line(r"t\.parquet: row 21: field 'text' must be a string, got NoneType"):
        read_documents(str(path))
    write_parquet(path, [{"instruction": "a", "output": "b"}, {"instruction": "c", "output": None}])
    with raises_one_line(r"t\.parquet: row 2: field 'output' must be a string, got NoneType"):
        read_documents(str(path))
    path.write_bytes(b"not parquet at all")
    with raises_one_line(r"t\.parquet: not a readable Parquet file"):
        read_documents(str(path))


def test_parquet_without_pyarrow_names_the_extra(tmp_path, monkeypatch):
    path = write_parquet(tmp_path / "t.parquet", [{"text": "x"}])
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)  # import pyarrow.parquet now raises ImportError
    with raises_one_line(r"t\.parquet: reading Parquet needs pyarrow, .*pip install 'preinfer\[parquet\]'"):
        read_documents(str(path))


def test_directories_and_globs_of_compressed_files(tmp_path):
    parts = [text_records(10, f"part{i}") for i in range(4)]
    for i, rows in enumerate(parts):
        plain = tmp_path / "shards" / f"part-{i}.jsonl"
        plain.parent.mkdir(exist_ok=True)
        plain.write_text(jsonl_text(rows), encoding="utf-8")
        compressed(plain, ".zst" if i % 2 else ".gz")
        plain.unlink()
    everything = [row["text"] for rows in parts for row in rows]
    assert read_documents(str(tmp_path / "shards")) == everything
    assert read_documents(str(tmp_path / "shards" / "part-*")) == everything
    assert read_documents(str(tmp_path / "**" / "*.jsonl.gz")) == [r["text"] for r in parts[0] + parts[2]]
    with raises_one_line("no file matches the pattern"):
        read_documents(str(tmp_path / "nothing-*.jsonl"))
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "a.md").write_text("x", encoding="utf-8")
    with raises_one_line(r"the pattern '.*' matches no \.txt or \.jsonl files"):
        read_documents(str(tmp_path / "notes" / "*"))
    write_parquet(tmp_path / "shards" / "part-9.parquet", [{"instruction": "a", "output": "b"}])
    with raises_one_line(r"part-9\.parquet holds instruction data, but .*part-0\.jsonl\.gz holds LM text"):
        read_documents(str(tmp_path / "shards"))


def test_text_paragraphs_are_the_same_whatever_the_read_blocks(tmp_path, monkeypatch):
    """Paragraphs split block by block (blocks of 1 to 9 bytes, breaks cut anywhere) equal the whole-text split."""
    rng = random.Random(0)
    path = tmp_path / "p.txt"
    for trial in range(300):
        text = "".join(rng.choice("ab \t\n\n\r\né") for _ in range(rng.randrange(0, 60)))
        path.write_text(text, encoding="utf-8", newline="")
        normal = text.replace("\r\n", "\n").replace("\r", "\n")
        expected = [p.strip("\n") for p in re.split(r"\n(?:[ \t]*\n)+", normal) if p.strip()]
        monkeypatch.setattr(corpus, "READ_BLOCK", 1 + trial % 9)
        assert read_documents(str(path)) == expected, repr(text)


def test_bad_bytes_and_records_in_compressed_files_name_the_place(tmp_path, monkeypatch):
    monkeypatch.setattr(corpus, "READ_BLOCK", 16)
    text = tmp_path / "t.txt"
    text.write_bytes("é".encode() * 30 + b"\xff tail")
    with raises_one_line(r"t\.txt\.zst: not UTF-8 text \(byte 60\)"):
        read_documents(str(compressed(text, ".zst")))
    records = tmp_path / "r.jsonl"
    records.write_text('{"text": "ok"}\n\n{"text": oops}\n', encoding="utf-8")
    with raises_one_line(r"r\.jsonl\.gz:3: not valid JSON"):
        read_documents(str(compressed(records, ".gz")))
    records.write_bytes(b'{"text": "ok"}\n{"text": "\xc3("}\n')
    with raises_one_line(r"r\.jsonl: not UTF-8 text \(byte 25\)"):
        read_documents(str(records))
    original = Path.open

    def denied(self, *args, **kwargs):
        if self == records:
            raise PermissionError(13, "Permission denied")
        return original(self, *args, **kwargs)

    monkeypatch.setattr(Path, "open", denied)
    with raises_one_line(r"r\.jsonl: cannot read it \(PermissionError: \[Errno 13\] Permission denied\)"):
        read_documents(str(records))
    monkeypatch.setattr(Path, "open", original)
    broken = tmp_path / "b.jsonl.gz"
    broken.write_bytes(gzip.compress(b'{"text": "x"}\n' * 100)[:40])
    with raises_one_line(r"b\.jsonl\.gz: cannot read it"):
        read_documents(str(broken))


def test_corpus_fingerprint_follows_content_not_place_or_time(tmp_path):
    root = write_corpora(tmp_path / "a")["directory"]
    digest, parts = corpus_fingerprint(str(root))
    data_files = [p for p in root.rglob("*") if p.suffix in (".txt", ".jsonl")]
    assert parts["files"] == len(data_files) == 4 and parts["bytes"] == sum(p.stat().st_size for p in data_files)
    copy = shutil.copytree(root, tmp_path / "elsewhere" / "dir")
    assert corpus_fingerprint(str(copy))[0] == digest
    edited = copy / "sub" / "c.txt"
    stat = edited.stat()
    data = bytearray(edited.read_bytes())
    data[0] ^= 1  # same size, and the same times below
    edited.write_bytes(bytes(data))
    os.utime(edited, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert corpus_fingerprint(str(copy))[0] != digest
    assert corpus_fingerprint(str(root), text_column="body")[0] != digest
    fingerprint = token_fingerprint(str(root), BYTE, 16, 0.2)
    assert token_fingerprint(str(root), BYTE, 17, 0.2).digest != fingerprint.digest
    assert token_fingerprint(str(root), BYTE, 16, 0.25).digest != fingerprint.digest
    assert cache_path(tmp_path, fingerprint) == tmp_path / fingerprint.digest[:20]


# ---- the job ----


@pytest.mark.slow
def test_bytes_are_the_same_across_reruns_and_worker_counts(tmp_path, capsys):
    path = write_corpora(tmp_path / "corpora")["txt"]
    build(path, tmp_path / "one")
    first = tree(tmp_path / "one")
    assert "token-store.json" in first and not any(name.startswith("staging") for name in first)
    build(path, tmp_path / "again")
    assert tree(tmp_path / "again") == first
    build(path, tmp_path / "two", workers=2)
    assert tree(tmp_path / "two") == first
    args = ["tokenize", "--data", str(path), "--seq-len", "16", "--eval-fraction", "0.2",
            "--out", str(tmp_path / "two")]
    code, out, _ = cli(args, capsys)  # the same store again: found complete, nothing written
    assert code == 0 and "up to date" in out and tree(tmp_path / "two") == first


CHILD = """
import os, signal, sys
import storage
from pipelines.data.token_store import TokenizeOptions, tokenize_corpus
from pipelines.data.token_store.layout import store_fields
from pipelines.data.token_store.staging import Staging

target, after = sys.argv[1], int(sys.argv[2])
owner, name = (Staging, "write_chunk") if target == "chunk" else (storage.Store, "write_shard")
original, calls = getattr(owner, name), []

def dying(self, *args, **kwargs):
    if len(calls) == after:
        os.kill(os.getpid(), signal.SIGKILL)
    calls.append(args[0])
    return original(self, *args, **kwargs)

setattr(owner, name, dying)
tokenize_corpus(TokenizeOptions(data=sys.argv[3], out=sys.argv[4], seq_len=16, eval_fraction=0.2, chunk_chars=300,
                                samples_per_shard=5, progress=False))
"""


@pytest.mark.distributed
@pytest.mark.parametrize("target,after", [("chunk", 4), ("shard", 9)])
def test_a_job_killed_with_sigkill_resumes_to_the_same_bytes(tmp_path, target, after):
    path = write_corpora(tmp_path / "corpora")["jsonl"]
    build(path, tmp_path / "reference")
    script = tmp_path / "child.py"
    script.write_text(CHILD, encoding="utf-8")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    out = tmp_path / "killed"
    child = subprocess.run([sys.executable, str(script), target, str(after), str(path), str(out)], env=env,
                           capture_output=True, timeout=240)
    assert child.returncode == -signal.SIGKILL, child.stderr.decode()[-2000:]
    assert not (out / "token-store.json").exists() and (out / "staging" / "plan.json").exists()
    staged = sorted((out / "staging").glob("chunk-*.json"))
    assert len(staged) == (after if target == "chunk" else len(staged)) and staged
    with pytest.raises(UsageError, match="no complete token store"):
        TokenStoreDataset(out, "train")
    build(path, out)
    assert tree(out) == tree(tmp_path / "reference")


@pytest.mark.slow
def test_out_directory_rules(tmp_path, capsys, monkeypatch):
    path = write_corpora(tmp_path / "corpora")["jsonl"]
    other = tmp_path / "other"
    other.mkdir()
    (other / "keep.txt").write_text("mine", encoding="utf-8")
    with raises_one_line(r"--out .*other is not empty and is not a token store .*'keep.txt'.*nothing was deleted"):
        build(path, other)
    with raises_one_line("is not empty and is not a token store"):
        build(path, other, overwrite=True)
    assert (other / "keep.txt").read_text(encoding="utf-8") == "mine"

    out = tmp_path / "tokens"
    build(path, out)
    before = tree(out)
    with raises_one_line(r"holds the token store of another corpus or setting \(seq_len: store has 16, expected 20"):
        build(path, out, seq_len=20)
    assert tree(out) == before
    assert build(path, out, seq_len=20, overwrite=True).seq_len == 20
    (out / "token-store.json").write_text("{garbled", encoding="utf-8")
    with raises_one_line(r"token-store\.json: unreadable .*`preinfer tokenize --overwrite`"):
        build(path, out, seq_len=20)
    assert build(path, out, seq_len=20, overwrite=True).seq_len == 20
    with pytest.raises(UsageError, match=r"built for another corpus or setting \(seq_len"):
        TokenStoreDataset(out, "train", expect=token_fingerprint(str(path), BYTE, 16, 0.2))

    with monkeypatch.context() as patch:  # a replacing run that stops after staging, then resumes
        patch.setattr(Staging, "finish_encoding", lambda *args: (_ for _ in ()).throw(KeyboardInterrupt))
        with pytest.raises(KeyboardInterrupt):
            build(path, out, seq_len=12, overwrite=True)
    assert TokenStoreDataset(out, "train").seq_len == 20  # still the old store
    assert build(path, out, seq_len=12, overwrite=True).seq_len == 12

    code, _, err = cli(["tokenize", "--data", str(path), "--out", str(out), "--eval-fraction", "2"], capsys)
    assert code == 2 and re.fullmatch(r"preinfer tokenize: error: eval_fraction must be in \[0, 1\], got 2\.0\n", err)
    code, _, err = cli(["tokenize", "--data", str(tmp_path / "absent.jsonl"), "--out", str(out)], capsys)
    assert code == 2 and "data file not found" in err and err.count("\n") == 1


@pytest.mark.slow
def test_a_resumed_job_keeps_its_settings(tmp_path, monkeypatch):
    path = write_corpora(tmp_path / "corpora")["jsonl"]
    out = tmp_path / "tokens"
    with monkeypatch.context() as patch:
        patch.setattr(Staging, "remove", lambda self: None)
        build(path, out)
    (out / "token-store.json").unlink()  # as if killed before the end
    with raises_one_line(r"holds an unfinished token store .*samples_per_shard: 5 then, 6 now.*--overwrite"):
        build(path, out, samples_per_shard=6)
    assert build(path, out, samples_per_shard=6, overwrite=True).store.samples_per_shard == 6


def test_split_without_samples_and_empty_corpus(tmp_path):
    path = write_corpora(tmp_path / "corpora")["jsonl"]
    dataset = build(path, tmp_path / "tokens", eval_fraction=0.0)
    assert len(dataset) == len(load_data(str(path), BYTE, 16, "train", 0.0))
    with raises_one_line(r"text\.jsonl \(eval\): 0 tokens in 0 documents, fewer than one full sequence"):
        TokenStoreDataset(tmp_path / "tokens", "eval")
    empty = tmp_path / "empty.txt"
    empty.write_text("\n \n", encoding="utf-8")
    with raises_one_line("no documents found"):
        build(empty, tmp_path / "none")
    bad = tmp_path / "bad.jsonl"
    bad.write_text(jsonl_text(text_records(40)) + "{oops\n", encoding="utf-8")
    with raises_one_line(r"bad\.jsonl:41: not valid JSON"):
        build(bad, tmp_path / "bad-tokens")
    before = tree(tmp_path / "tokens")
    with raises_one_line(r"bad\.jsonl:41: not valid JSON"):
        build(bad, tmp_path / "tokens", overwrite=True)
    assert tree(tmp_path / "tokens") == before  # the store it was to replace is intact
    assert not (tmp_path / "none").exists() and not (tmp_path / "bad-tokens").exists()  # bad input leaves nothing


def test_lazy_reads_touch_only_the_shards_they_need(tmp_path):
    path = write_corpora(tmp_path / "corpora")["txt"]
    dataset = build(path, tmp_path / "tokens")
    reference = load_data(str(path), BYTE, 16, "train", 0.2)
    reads = []
    original = dataset.store.read_shard
    dataset.store.read_shard = lambda shard, *args, **kwargs: reads.append(shard) or original(shard, *args, **kwargs)
    batch = dataset[torch.tensor([11, 3, 12, 4])]  # shards 2, 0, 2, 0 (5 samples per shard)
    assert sorted(reads) == [0, 2] and torch.equal(batch["input_ids"], reference.input_ids[[11, 3, 12, 4]])
    dataset[[13, 14, 1]]  # both shards are still decoded
    assert sorted(reads) == [0, 2]
    with pytest.raises(IndexError):
        dataset[len(reference)]
    head = dataset.head(7)
    assert len(head) == 7 and torch.equal(head[:]["labels"], reference.labels[:7])
    assert head.num_tokens == 7 * 16 and head.fingerprint() != dataset.fingerprint()
    assert dataset.fingerprint() == TokenStoreDataset(tmp_path / "tokens", "train").fingerprint()


@pytest.mark.slow
def test_bench_data_runs_on_small_corpora(tmp_path):
    """The benchmark's own machinery on tiny corpora (no speed or memory assertion: only what holds anywhere)."""
    from bench import data as bench

    out = tmp_path / "data.json"
    assert bench.main(["--sizes", "60k", "--hf-size", "60k", "--bcd-base", "0", "--cache-window", "0",
                       "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert [(row["tokenizer"], row["size"]) for row in result["rows"]] == [("byte", 60_000), ("hf-bpe", 60_000)]
    byte, hf = result["rows"]
    assert byte["tokens"] > 0.9 * 60_000 and 0 < hf["tokens"] < byte["tokens"]
    assert all(row["peak_rss_mb"] > 0 and row["store_mb"] > 0 and row["mb_per_s"] > 0 for row in result["rows"])
    assert set(result["targets"]) == {"byte_mb_per_s_per_process", "tokenize_peak_rss_growth_mb"}
