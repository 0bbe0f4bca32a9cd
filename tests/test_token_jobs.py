"""Every job reads its tokens lazily from the on-disk token store: the same training as from in-memory tensors,
explicit token stores checked against the job's settings, a capped evaluation timed apart."""

import json
import pickle
import threading

import pytest
import torch
from safetensors.torch import load_file

import storage
from pipelines import training
from pipelines.cli import main
from pipelines.data.batches import TOKEN_FIELDS, ReaderBatches, TokenShards
from pipelines.data.token_store import TokenizeOptions, TokenStoreDataset, tokenize_corpus
from pipelines.data.token_store.resolve import default_token_root
from pipelines.training import load_datasets
from preinfer.config import Config, load_config
from pipelines.data.in_memory import TokenDataset, load_data
from preinfer.errors import UsageError
from preinfer.run_dir import RunDir
from preinfer.batch_source import LiveSources
from pipelines.data.tokenizers import load_tokenizer
from tests.helpers.training_runs import config_for

SEQ = 32


def small_config(tmp_path, corpus: str, name: str) -> Config:
    """test_from_store's tiny run, live, without evaluation."""
    config = config_for(tmp_path, corpus, name, mode="off")
    config.data.eval_tokens = 0
    return config


def memory_batches(dataset: TokenDataset, config: Config, shuffle: bool) -> ReaderBatches:
    """The path before the token store: the split's tensors whole in memory, written into a memory store."""
    n = len(dataset)
    fields = {k: ((SEQ,), getattr(dataset, k).dtype) for k in TOKEN_FIELDS}
    store = storage.create_store(f"reference-{dataset.split}-{shuffle}", fields, n, config.data.samples_per_shard,
                                 storage.Fingerprint(dataset.fingerprint(), {}), format="memory", overwrite=True)
    for shard in store.missing_shards():
        start, stop = store.shard_range(shard)
        store.write_shard(shard, {k: getattr(dataset, k)[start:stop] for k in TOKEN_FIELDS})
    store.finalize()
    return ReaderBatches(store, 0, config.data.batch_size, config.run.seed, shuffle=shuffle)


def test_training_through_the_token_store_equals_training_from_tensors_in_memory(tmp_path, corpus, monkeypatch):
    stored = small_config(tmp_path, corpus, "stored")
    training.run(stored, quiet=True)
    tokenizer = load_tokenizer("byte")
    reference = {split: load_data(corpus, tokenizer, SEQ, split, 0.2) for split in ("train", "eval")}
    monkeypatch.setattr(training.runner, "live_sources", lambda data, config, *_: LiveSources(
        memory_batches(reference["train"], config, True), memory_batches(reference["eval"], config, False)))
    memory = small_config(tmp_path, corpus, "memory")
    training.run(memory, quiet=True)
    a, b = (load_file(str(RunDir(c.run.out).checkpoint_weights)) for c in (stored, memory))
    for name in b:
        relative = (a[name] - b[name]).norm() / b[name].norm().clamp_min(1e-12)
        assert relative.item() <= 1e-5, (name, relative.item())


def test_a_corpus_is_tokenised_once_into_the_cache_and_read_lazily(tmp_path, corpus, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    config = small_config(tmp_path, corpus, "run")
    data = load_datasets(config, quiet=True)
    assert isinstance(data.train, TokenStoreDataset)
    assert data.train.path.parent == default_token_root() == tmp_path / "cache" / "preinfer" / "tokens"
    reference = load_data(corpus, load_tokenizer("byte"), SEQ, "train", 0.2)
    assert torch.equal(data.train[: len(data.train)]["input_ids"], reference.input_ids)
    info = (data.train.path / "token-store.json").stat().st_mtime_ns
    again = load_datasets(config, quiet=True)  # found, not built again
    assert again.train.path == data.train.path and (data.train.path / "token-store.json").stat().st_mtime_ns == info
    config.data.token_store = str(tmp_path / "elsewhere")
    assert load_datasets(config, quiet=True).train.path.parent == tmp_path / "elsewhere"


def test_the_eval_split_is_capped_by_eval_tokens_to_the_same_first_samples(tmp_path, corpus):
    config = small_config(tmp_path, corpus, "run")
    whole = load_datasets(config, quiet=True).eval
    config.data.eval_tokens = 2 * SEQ + 1
    capped = load_datasets(config, quiet=True).eval
    assert len(whole) > 3 and len(capped) == 3
    assert torch.equal(capped[0:3]["input_ids"], whole[0:3]["input_ids"])


def test_evaluation_time_is_reported_apart_from_training(tmp_path, corpus, capsys):
    out = tmp_path / "run"
    code = main(["bcd", "--model", "tiny-llama", "--data", corpus, "--seq-len", str(SEQ), "--batch-size", "4",
                 "--steps-per-visit", "1", "--blocks", "2", "--eval-tokens", "64", "--out", str(out)])
    assert code in (0, None)
    assert "+ eval " in capsys.readouterr().out
    summary = json.loads(RunDir(out).summary.read_text())
    assert all(v["eval_s"] > 0 for v in summary["visits"])
    assert summary["eval_s"] == pytest.approx(sum(v["eval_s"] for v in summary["visits"]))


def test_a_dask_task_carries_the_token_store_path_not_its_samples(tmp_path, corpus):
    tokenize_corpus(TokenizeOptions(data=corpus, seq_len=SEQ, out=str(tmp_path / "tokens"), progress=False))
    dataset = TokenStoreDataset(tmp_path / "tokens", "train").head(5)
    carried = pickle.dumps(dataset)
    assert len(carried) < 500
    reopened = pickle.loads(carried)
    assert len(reopened) == 5 and torch.equal(reopened[0:5]["input_ids"], dataset[0:5]["input_ids"])


def test_the_old_eval_batches_key_is_refused_in_one_line(tmp_path):
    path = tmp_path / "old.toml"
    path.write_text("[data]\neval_batches = 2\n")
    with pytest.raises(UsageError, match=r"\[data\] eval_batches is gone: write eval_tokens"):
        load_config(path)


@pytest.fixture(scope="module")
def token_dir(tmp_path_factory, corpus) -> str:
    out = tmp_path_factory.mktemp("explicit") / "tokens"
    tokenize_corpus(TokenizeOptions(data=corpus, seq_len=SEQ, eval_fraction=0.2, out=str(out), progress=False))
    return str(out)


@pytest.mark.parametrize("flags, expected", [
    (["--seq-len", "64"], "is a token store of 32-token samples, not of --seq-len 64; pass --seq-len 32"),
    (["--eval-fraction", "0.1"], "split with eval fraction 0.2, not 0.1; pass --eval-fraction 0.2"),
])
def test_a_token_store_made_with_other_settings_is_refused_in_one_line(tmp_path, token_dir, flags, expected, capsys):
    base = ["--model", "tiny-llama", "--data", token_dir, "--seq-len", str(SEQ), "--eval-fraction", "0.2"]
    assert main(["bcd", *base, *flags, "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip()
    assert expected in err and "\n" not in err and "Traceback" not in err
    assert not (tmp_path / "run").exists()


def test_every_job_works_with_data_naming_a_token_store(tmp_path, token_dir, capsys):
    common = ["--data", token_dir, "--seq-len", str(SEQ), "--eval-fraction", "0.2"]
    run = tmp_path / "run"

    def ok(argv: list[str]) -> str:
        code = main(argv)
        out = capsys.readouterr().out
        assert code in (0, None), out
        return out

    ok(["bcd", "--model", "tiny-llama", *common, "--batch-size", "4", "--steps-per-visit", "1", "--blocks", "2",
        "--eval-tokens", "64", "--out", str(run), "--pre-inference", "on"])
    cache = tmp_path / "cache"
    ok(["cache", "--model", str(run), *common, "--boundary", "1", "--out", str(cache), "--quiet"])
    ok(["train", "--model", str(run), "--store", str(cache), "--batch-size", "4", "--steps-per-visit", "1",
        "--eval-tokens", "64", "--out", str(tmp_path / "suffix")])
    result = json.loads(ok(["eval", "--model", str(run), *common, "--json"]))
    assert result["samples"] == len(TokenStoreDataset(token_dir, "eval"))
    assert "verify: OK" in ok(["verify", str(cache), "--model", str(run), "--data", token_dir, "--eval-fraction", "0.2",
                               "--sample", "2"])


def test_an_evaluation_limit_reads_the_first_samples_in_stored_order(token_dir):
    dataset = TokenStoreDataset(token_dir, "train")
    batches = ReaderBatches(TokenShards(dataset, 3), 0, batch_size=4, shuffle=False, limit=5)
    read = [batch["input_ids"] for batch in batches.one_pass()]
    assert [len(ids) for ids in read] == [4, 1]
    assert torch.equal(torch.cat(read), dataset[0:5]["input_ids"])


def test_token_batches_are_read_in_the_callers_thread_in_the_order_of_a_prefetching_reader(token_dir):
    shards = TokenShards(TokenStoreDataset(token_dir, "train"), 3)
    batches = ReaderBatches(shards, 0, batch_size=4, seed=5)
    threads = threading.active_count()
    read = [next(batches)["input_ids"] for _ in range(2 * batches.batches_per_epoch)]  # two epochs
    assert threading.active_count() == threads  # no prefetching thread competes with the trainer
    prefetching = storage.Reader(shards, 4, seed=5, prefetch=4, threads=2)
    expected = [batch["input_ids"] for _ in range(2) for batch in prefetching]
    assert len(read) == len(expected) and all(torch.equal(a, b) for a, b in zip(read, expected))


def test_the_real_tokens_of_a_capped_split_are_counted_shard_by_shard(tmp_path):
    records = [{"instruction": f"do {i} " * (i % 5 + 1), "output": f"ok {i} " * (i % 7 + 1)} for i in range(120)]
    corpus = tmp_path / "instructions.jsonl"
    corpus.write_text("\n".join(json.dumps(record) for record in records))
    tokenize_corpus(TokenizeOptions(data=str(corpus), seq_len=64, out=str(tmp_path / "tokens"), samples_per_shard=7,
                                    progress=False))
    head = TokenStoreDataset(tmp_path / "tokens", "train").head(20)
    assert head.num_tokens == int(head[0:20]["attention_mask"].sum()) < 20 * 64
