"""The caching job (`pipelines.cache`, `preinfer cache`): stored states, fingerprints, resume, roll-forward,
faults, bad input, and the CUDA staging path on CPU. Dask and SIGKILL tests are in the other test_cache_* files."""

import errno
import functools
import json
from pathlib import Path

import pytest
import torch

import preinfer
from pipelines.cache import (
    CacheOptions, cache_boundary, cache_fingerprint, default_samples_per_shard, roll_forward,
)
from pipelines.cache import local_runner, parse_dask, shards
from pipelines.cache.fingerprints import store_fields
from pipelines.cache.options import LocalWorkers, Part, SchedulerAddress
from pipelines.cache.result import CacheJobError
from pipelines.data.in_memory import TokenDataset, load_data
from pipelines.data.tokenizers import load_tokenizer
from storage import StaleStoreError, create_store, open_store
from tests.helpers.cache_jobs import (
    BATCH, PER_SHARD, SEQ, assert_same_cache, cache, datasets_for, staged_model, stored_datasets,
)
from tests.helpers.cli_run import run_cli
from tests.helpers.shard_faults import cli_hook, fail_once, fail_shards


def direct_prefix(staged, dataset, boundary, lo, hi, batch=BATCH) -> dict[str, torch.Tensor]:
    """The prefix forward of samples [lo, hi) in batches of `batch` from lo, with nothing stored."""
    parts = []
    with torch.inference_mode():
        for a in range(lo, hi, batch):
            rows = dataset[a:min(a + batch, hi)]
            state = staged.embed(rows["input_ids"], rows["attention_mask"], rows["labels"])
            parts.append(staged.run(state, 0, boundary).to_dict())
    return {k: torch.cat([p[k] for p in parts]) for k in parts[0]}


# ---- stored states and layout ---------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("model", ["tiny-llama", "tiny-gpt2"])
def test_stored_states_equal_a_direct_prefix_forward_bit_exactly(model, cache_corpus, tmp_path):
    staged, data = staged_model(model), datasets_for(cache_corpus)
    result = cache(staged, data, 2, tmp_path / "c", model_name=model)
    assert set(result.splits) == {"train", "eval"} and result.shards_computed == result.shards_skipped + sum(
        s.num_shards for s in result.splits.values())
    for split, dataset in data.items():
        store = open_store(tmp_path / "c" / split)
        assert store.num_samples == len(dataset) and store.is_complete and store.manifest["complete"]
        assert {n: (list(s.shape), s.dtype) for n, s in store.fields.items()} == {
            "hidden": ([SEQ, 64], "float32"), "attention_mask": ([SEQ], "bool"), "position_ids": ([SEQ], "int64"),
            "labels": ([SEQ], "int64")}
        for i in range(store.num_shards):
            lo, hi = store.shard_range(i)
            stored, expected = store.read_shard(i), direct_prefix(staged, dataset, 2, lo, hi)
            for name in expected:
                assert torch.equal(stored[name], expected[name].to(stored[name].dtype)), (split, i, name)
        assert store.fingerprint == result.splits[split].fingerprint
        assert store.fingerprint == cache_fingerprint(staged, dataset, load_tokenizer("byte"), 2, "auto",
                                                              model)
    index = json.loads((tmp_path / "c" / "cache.json").read_text())
    assert index["boundary"] == 2 and set(index["splits"]) == {"train", "eval"}


def test_a_lower_dtype_is_explicit_and_recorded(cache_corpus, tmp_path):
    staged, data = staged_model(), datasets_for(cache_corpus)
    result = cache(staged, {"eval": data["eval"]}, 2, tmp_path / "c", store_dtype="bfloat16",
                   store_format="safetensors")
    store = open_store(tmp_path / "c" / "eval")
    assert store.fields["hidden"].dtype == "bfloat16" and store.fingerprint.parts["dtype"] == "bfloat16"
    assert result.store_dtype == "bfloat16" and store.format == "safetensors"
    expected = direct_prefix(staged, data["eval"], 2, *store.shard_range(0))["hidden"].to(torch.bfloat16)
    assert torch.equal(store.read_shard(0)["hidden"], expected)


def test_default_samples_per_shard_aims_at_64_mib():
    assert default_samples_per_shard(1024, 4096, torch.bfloat16) == 8  # 8 MiB per sample
    assert default_samples_per_shard(128, 256, torch.float32) == 512  # 128 KiB per sample
    assert default_samples_per_shard(8192, 8192, torch.float32) == 1  # never zero


# ---- fingerprints ---------------------------------------------------------------------------------------------


def test_fingerprint_changes_exactly_when_it_should(cache_corpus):
    tokenizer = load_tokenizer("byte")
    staged, data = staged_model(), datasets_for(cache_corpus)
    train = data["train"]
    base = cache_fingerprint(staged, train, tokenizer, 2, "auto", "tiny-llama")

    def fp(model=staged, dataset=train, boundary=2, dtype="auto", name="tiny-llama"):
        return cache_fingerprint(model, dataset, tokenizer, boundary, dtype, name)

    assert fp() == base
    assert fp(name="elsewhere/tiny-llama").digest == base.digest  # the name is readable, not content
    with torch.no_grad():
        staged.layers[2].mlp.up_proj.weight[0, 0] += 1.0  # above the boundary: irrelevant
        assert fp().digest == base.digest
        staged.model.lm_head.weight[0, 0] += 1.0  # the head (untied in Llama)
        assert fp().digest == base.digest
        staged.layers[1].self_attn.q_proj.weight[3, 5] += 1e-3  # one prefix weight
        changed = fp()
        staged.layers[1].self_attn.q_proj.weight[3, 5] -= 1e-3
    assert changed.digest != base.digest and changed.parts["prefix"] != base.parts["prefix"]
    assert [d.split(":")[0] for d in changed.differences(base)] == ["prefix"]
    assert fp(boundary=3).digest != base.digest
    assert fp(dtype="bfloat16").digest != base.digest
    assert fp(dataset=data["eval"]).digest != base.digest
    shorter = TokenDataset(train.input_ids[:-1], train.attention_mask[:-1], train.labels[:-1], train.source, "train")
    assert fp(dataset=shorter).digest != base.digest
    other_len = load_data(cache_corpus, tokenizer, SEQ * 2, "train", 0.1)
    changed_len = fp(dataset=other_len)
    assert changed_len.digest != base.digest and changed_len.parts["seq_len"] == SEQ * 2
    staged.model.set_attn_implementation("eager")  # the same weights' states differ in their last bits
    eager = fp()
    assert eager.digest != base.digest and [d.split(":")[0] for d in eager.differences(base)] == ["attention"]


def test_a_tied_weight_changes_every_boundary_above_its_first_use():
    staged = staged_model("tiny-gpt2")
    dataset = TokenDataset(torch.zeros(2, 8, dtype=torch.long), torch.ones(2, 8, dtype=torch.bool),
                           torch.zeros(2, 8, dtype=torch.long), "x", "train")
    before = cache_fingerprint(staged, dataset, load_tokenizer("byte"), 1)
    with torch.no_grad():
        staged.model.lm_head.weight[7, 0] += 1.0  # tied to transformer.wte, used by the embedding
    assert cache_fingerprint(staged, dataset, load_tokenizer("byte"), 1).digest != before.digest


def test_another_fingerprint_at_out_is_refused_unless_overwrite(cache_corpus, tmp_path, capsys):
    staged, data = staged_model(), datasets_for(cache_corpus)
    eval_only = {"eval": data["eval"]}
    cache(staged, eval_only, 2, tmp_path / "c")
    with torch.no_grad():
        staged.layers[0].mlp.down_proj.weight[0, 0] += 1.0
    with pytest.raises(StaleStoreError, match=r"prefix: store has .*--overwrite"):
        cache(staged, eval_only, 2, tmp_path / "c")
    result = cache(staged, eval_only, 2, tmp_path / "c", mode="overwrite")
    assert open_store(tmp_path / "c" / "eval").fingerprint == result.splits["eval"].fingerprint
    # the CLI: exit 1, one line naming the differing part
    argv = ["cache", "--model", "tiny-llama", "--data", cache_corpus, "--seq-len", str(SEQ), "--boundary", "3",
            "--out", str(tmp_path / "c"), "--splits", "eval", "--samples-per-shard", str(PER_SHARD), "--quiet"]
    code, _, err = run_cli(argv, capsys)
    assert code == 1 and "boundary: store has 2, expected 3" in err and "--overwrite" in err
    assert len(err.strip().splitlines()) == 1


# ---- resume ---------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_rerunning_a_completed_job_is_a_quick_no_op(cache_corpus, tmp_path, monkeypatch):
    staged, data = staged_model(), datasets_for(cache_corpus)
    cache(staged, data, 2, tmp_path / "c")
    files = {p: p.stat().st_mtime_ns for p in (tmp_path / "c").rglob("*") if p.is_file() and "locks" not in p.parts}
    monkeypatch.setattr(staged, "run", lambda *a, **k: pytest.fail("a completed store must not run the model"))
    result = cache(staged, data, 2, tmp_path / "c")
    assert result.shards_computed == 0 and result.bytes_written == 0
    assert result.shards_skipped == sum(s.num_shards for s in result.splits.values())
    changed = [p for p, t in files.items() if p.stat().st_mtime_ns != t and p.name not in ("manifest.json",
                                                                                            "cache.json")]
    assert changed == [] and "already complete" in result.summary()


@pytest.mark.slow
def test_resume_computes_only_the_missing_shards(cache_corpus, tmp_path):
    staged, data = staged_model(), datasets_for(cache_corpus)
    cache(staged, data, 2, tmp_path / "ref")
    store = create_store(
        tmp_path / "c" / "train", store_fields(SEQ, 64, torch.float32), len(data["train"]), PER_SHARD,
        cache_fingerprint(staged, data["train"], load_tokenizer("byte"), 2, "auto", "tiny-llama"))
    reference = open_store(tmp_path / "ref" / "train")
    for i in (0, 2, 3):  # an interrupted run left these shards
        store.write_shard(i, reference.read_shard(i))
    result = cache(staged, data, 2, tmp_path / "c")
    assert result.splits["train"].shards_skipped == 3
    assert result.splits["train"].shards_computed == store.num_shards - 3
    assert_same_cache(tmp_path / "c", tmp_path / "ref")


# ---- roll-forward ---------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_roll_forward_equals_a_fresh_run_store_and_fingerprint(cache_corpus, tmp_path, capsys):
    staged, data = staged_model(), datasets_for(cache_corpus)
    cache(staged, data, 1, tmp_path / "k1")
    with torch.no_grad():  # a visit of block [1, 3) trained those layers; the store at 1 stays valid
        for p in staged.layers[1].parameters():
            p.mul_(1.01)
    fresh = cache(staged, data, 3, tmp_path / "fresh")
    rolled = roll_forward(staged, tmp_path / "k1", 3, tmp_path / "rolled", CacheOptions(
        samples_per_shard=PER_SHARD, batch_size=BATCH, progress=False, model_name="tiny-llama"))
    assert rolled.source_boundary == 1 and rolled.fingerprints == fresh.fingerprints
    assert rolled.tokens == fresh.tokens
    assert_same_cache(tmp_path / "rolled", tmp_path / "fresh")
    # the CLI, from the stored weights of a preset: a fresh cache at 2 and a roll 2 -> 4 against a fresh 4
    common = ["--model", "tiny-llama", "--data", cache_corpus, "--seq-len", str(SEQ), "--samples-per-shard",
              str(PER_SHARD), "--batch-size", str(BATCH), "--splits", "eval", "--quiet"]
    for boundary, out, extra in ((2, "k2", []), (4, "k4", []), (4, "r4", ["--from-store", str(tmp_path / "k2")])):
        code, stdout, err = run_cli(["cache", *common, "--boundary", str(boundary), "--out", str(tmp_path / out),
                                     *extra], capsys)
        assert code == 0, err
    assert "rolled forward 2->4" in stdout
    assert_same_cache(tmp_path / "r4", tmp_path / "k4", splits=("eval",))


def test_roll_forward_refuses_a_stale_or_lower_dtype_source(cache_corpus, tmp_path):
    staged, data = staged_model(), datasets_for(cache_corpus)
    eval_only = {"eval": data["eval"]}
    cache(staged, eval_only, 1, tmp_path / "k1")
    cache(staged, eval_only, 1, tmp_path / "bf16", store_dtype="bfloat16")
    options = CacheOptions(samples_per_shard=PER_SHARD, progress=False)
    with pytest.raises(preinfer.errors.UsageError, match="lower dtype"):
        roll_forward(staged, tmp_path / "bf16", 3, tmp_path / "x", options)
    with pytest.raises(preinfer.errors.UsageError, match=r"outside \[2, 4\]"):
        roll_forward(staged, tmp_path / "k1", 1, tmp_path / "x", options)
    with torch.no_grad():
        staged.layers[0].input_layernorm.weight[0] += 1.0  # the source's prefix changed
    with pytest.raises(StaleStoreError, match="prefix"):
        roll_forward(staged, tmp_path / "k1", 3, tmp_path / "x", options)
    assert not (tmp_path / "x" / "eval").exists()


# ---- faults ---------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_shard_that_fails_once_is_retried(cache_corpus, tmp_path, monkeypatch):
    staged, data = staged_model(), datasets_for(cache_corpus)
    hook = functools.partial(fail_once, str(tmp_path), frozenset({"train/1", "eval/0"}))
    result = cache(staged, data, 2, tmp_path / "c", retries=1, before_shard_write=hook)
    assert (tmp_path / "fault-train-1").exists() and (tmp_path / "fault-eval-0").exists()
    cache(staged, data, 2, tmp_path / "ref")
    assert result.shards_computed == result.splits["train"].num_shards + result.splits["eval"].num_shards
    assert_same_cache(tmp_path / "c", tmp_path / "ref")


@pytest.mark.slow
def test_a_shard_that_always_fails_names_itself_and_leaves_finished_shards_intact(cache_corpus, tmp_path, monkeypatch,
                                                                                 capsys):
    staged, data = staged_model(), stored_datasets(cache_corpus)
    cache(staged, data, 2, tmp_path / "ref")
    cli_hook(monkeypatch, functools.partial(fail_shards, frozenset({"train/1"})))
    argv = ["cache", "--model", "tiny-llama", "--data", cache_corpus, "--seq-len", str(SEQ), "--boundary", "2",
            "--out", str(tmp_path / "c"), "--samples-per-shard", str(PER_SHARD), "--batch-size", str(BATCH),
            "--retries", "1", "--quiet"]
    code, _, err = run_cli(argv, capsys)
    assert code == 1 and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert "1 shard failed: train shard 1 (samples 16..32)" in err and "injected fault" in err
    store, reference = open_store(tmp_path / "c" / "train"), open_store(tmp_path / "ref" / "train")
    assert store.missing_shards() == [1] and not store.manifest["complete"]
    for i in store.completed_shards():
        assert all(torch.equal(a, b) for a, b in zip(store.read_shard(i).values(), reference.read_shard(i).values()))
    assert open_store(tmp_path / "c" / "eval").is_complete  # the other split went on
    assert not (tmp_path / "c" / "cache.json").exists()  # nothing claims the cache is complete
    monkeypatch.undo()
    assert run_cli(argv, capsys)[0] == 0  # rerunning finishes it
    assert_same_cache(tmp_path / "c", tmp_path / "ref")


def test_a_full_disk_stops_the_job_with_one_line_and_finished_shards_intact(cache_corpus, tmp_path, monkeypatch,
                                                                            capsys):
    from storage.zarr_backend import ZarrStore

    original = ZarrStore._write_data
    attempts = []

    def full_disk(self, i, tensors):
        attempts.append(i)
        if i >= 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        return original(self, i, tensors)

    monkeypatch.setattr(ZarrStore, "_write_data", full_disk)
    argv = ["cache", "--model", "tiny-llama", "--data", cache_corpus, "--seq-len", str(SEQ), "--boundary", "2",
            "--out", str(tmp_path / "c"), "--samples-per-shard", str(PER_SHARD), "--quiet"]
    code, _, err = run_cli(argv, capsys)
    assert code == 1 and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert "disk full" in err and "No space left on device" in err and "2 of" in err
    assert attempts.count(2) == 1  # a full disk is not retried
    store = open_store(tmp_path / "c" / "train")
    assert store.completed_shards() == [0, 1] and not store.manifest["complete"]
    assert not (tmp_path / "c" / "cache.json").exists()
    monkeypatch.setattr(ZarrStore, "_write_data", original)
    assert run_cli(argv, capsys)[0] == 0 and open_store(tmp_path / "c" / "train").manifest["complete"]


# ---- bad input ------------------------------------------------------------------------------------------------


def not_utf8(tmp_path):
    path = tmp_path / "binary.txt"
    path.write_bytes(b"\xff\xfe\x00garbage" * 10)
    return str(path)


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--boundary", "0"], "--boundary 0 is outside [1, 4]"),
        (["--boundary", "5"], "--boundary 5 is outside [1, 4]"),
        (["--data", "/nonexistent/corpus.txt"], "/nonexistent/corpus.txt"),
        (["--data", "NOT_UTF8"], "not UTF-8"),
        (["--out", "A_FILE"], "is a file"),
        (["--out", "FOREIGN"], "not a cache directory"),
        (["--dtype", "int4"], "--dtype"),
        (["--store-format", "zarr", "--codec", "lzma"], "unknown codec"),
        (["--store-format", "safetensors", "--codec", "blosc-zstd"], "raw bytes"),
        (["--splits", "test"], "--splits"),
        (["--dask", "nowhere"], "--dask"),
    ],
)
def test_bad_input_is_one_line_and_exit_code_2(extra, message, cache_corpus, tmp_path, capsys):
    (tmp_path / "a_file").write_text("x")
    (tmp_path / "foreign").mkdir()
    (tmp_path / "foreign" / "notes.txt").write_text("mine")
    replace = {"NOT_UTF8": not_utf8(tmp_path), "A_FILE": str(tmp_path / "a_file"),
               "FOREIGN": str(tmp_path / "foreign")}
    extra = [replace.get(x, x) for x in extra]
    argv = ["cache", "--model", "tiny-llama", "--data", cache_corpus, "--seq-len", str(SEQ), "--boundary", "2",
            "--out", str(tmp_path / "c"), "--quiet", *extra]
    code, _, err = run_cli(argv, capsys)
    assert code == 2, err
    assert message in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert (tmp_path / "foreign" / "notes.txt").read_text() == "mine"
    assert not (tmp_path / "c" / "train").exists()


def test_an_unreadable_data_file_is_exit_code_2(cache_corpus, tmp_path, monkeypatch, capsys):
    original = Path.open

    def denied(self, *args, **kwargs):
        if str(self) == cache_corpus:
            raise PermissionError(errno.EACCES, "Permission denied", str(self))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(Path, "open", denied)
    code, _, err = run_cli(["cache", "--model", "tiny-llama", "--data", cache_corpus, "--boundary", "2", "--out",
                            str(tmp_path / "c"), "--quiet"], capsys)
    assert code == 2 and f"{cache_corpus}: cannot read it" in err and "Permission denied" in err


# ---- the CUDA staging path, on CPU ----------------------------------------------------------------------------


class CountingEvent:
    def __init__(self):
        self.waited = 0

    def synchronize(self):
        self.waited += 1


def test_asynchronous_host_staging_path_runs_on_cpu_and_reuses_buffers(cache_corpus, tmp_path, monkeypatch):
    staged, data = staged_model(), datasets_for(cache_corpus)
    dataset = data["train"]
    fields = {n: (shape, dtype) for n, (shape, dtype) in store_fields(SEQ, 64, torch.float32).items()}
    stager = shards.HostStager("cpu", asynchronous=True, max_pooled=1)
    assert stager.asynchronous and not stager.pin  # pinned memory only where CUDA is
    copies = []
    original_copy = shards.HostStager.copy

    def spy_copy(self, destination, source):
        copies.append(source.shape[0])
        return original_copy(self, destination, source)

    monkeypatch.setattr(shards.HostStager, "copy", spy_copy)
    inputs = shards.DatasetInputs(staged, dataset, "cpu")
    buffers, fence = shards.compute_shard(staged, inputs, 0, 2, 0, PER_SHARD, BATCH, fields, stager)
    fence.synchronize()
    expected = direct_prefix(staged, dataset, 2, 0, PER_SHARD)
    assert all(torch.equal(buffers[k], expected[k]) for k in expected)
    assert copies == [b for b in (BATCH, BATCH, PER_SHARD - 2 * BATCH) for _ in range(4)]  # 4 fields per batch
    stager.release(buffers)
    again, _ = shards.compute_shard(staged, inputs, 0, 2, PER_SHARD, 2 * PER_SHARD, BATCH, fields, stager)
    assert again["hidden"].data_ptr() == buffers["hidden"].data_ptr() and stager.allocated == 1
    # the writer waits on the fence before it touches the buffers
    event = CountingEvent()
    monkeypatch.setattr(shards.HostStager, "fence", lambda self: event)
    monkeypatch.setattr(local_runner, "HostStager", lambda device, **kw: stager)
    result = cache_boundary(staged, {"eval": data["eval"]}, load_tokenizer("byte"), 2, tmp_path / "c",
                            CacheOptions(samples_per_shard=PER_SHARD, batch_size=BATCH, progress=False))
    assert event.waited == result.shards_computed > 0


def test_a_shard_whose_forward_fails_is_named_and_the_others_are_written(cache_corpus, tmp_path, monkeypatch):
    staged, data = staged_model(), datasets_for(cache_corpus)
    original = shards.DatasetInputs.__call__

    def broken(self, a, b):
        if a <= 20 < b:  # a sample of train shard 1
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return original(self, a, b)

    monkeypatch.setattr(shards.DatasetInputs, "__call__", broken)
    with pytest.raises(CacheJobError, match=r"train shard 1 \(samples 16..32\).*illegal memory access"):
        cache(staged, {"train": data["train"]}, 2, tmp_path / "c", retries=1)
    store = open_store(tmp_path / "c" / "train")
    assert store.missing_shards() == [1] and len(store.completed_shards()) == store.num_shards - 1


def test_the_old_flag_spellings_still_work_with_a_note(cache_corpus, tmp_path, capsys):
    argv = ["cache", "--model", "tiny-llama", "--data", cache_corpus, "--seq-len", str(SEQ), "--boundary", "2",
            "--splits", "eval", "--samples-per-shard", str(PER_SHARD), "--quiet"]
    code, _, err = run_cli([*argv, "--out", str(tmp_path / "old"), "--dtype", "bfloat16", "--format",
                            "safetensors"], capsys)
    assert code == 0, err
    assert "--dtype is deprecated, use --store-dtype" in err and "--format is deprecated, use --store-format" in err
    code, _, err = run_cli([*argv, "--out", str(tmp_path / "new"), "--store-dtype", "bfloat16", "--store-format",
                            "safetensors"], capsys)
    assert code == 0 and err == ""
    assert_same_cache(tmp_path / "old", tmp_path / "new", splits=("eval",))
    assert open_store(tmp_path / "new" / "eval").format == "safetensors"


@pytest.mark.slow
def test_a_split_directory_given_as_the_cache_is_one_line_naming_the_root(cache_corpus, tmp_path, capsys):
    cache(staged_model(), datasets_for(cache_corpus), 2, tmp_path / "c")
    code, _, err = run_cli(["train", "--store", str(tmp_path / "c" / "train"), "--model", "tiny-llama", "--out",
                            str(tmp_path / "run"), "--steps-per-visit", "1"], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert f"pass the cache root {tmp_path / 'c'}" in err


def test_cache_options_are_checked_when_made():
    assert parse_dask("local:3") == LocalWorkers(3) and str(parse_dask("local:3")) == "local:3"
    assert parse_dask("tcp://10.0.0.1:8786") == SchedulerAddress("tcp://10.0.0.1:8786")
    for bad in ("local:0", "local:x", "10.0.0.1:8786"):
        with pytest.raises(preinfer.errors.UsageError, match=f"--dask '{bad}': expected"):
            parse_dask(bad)
    assert CacheOptions(dask="local:2").dask == LocalWorkers(2) and CacheOptions().workers == "1"
    assert CacheOptions(store_dtype=torch.bfloat16).store_dtype == "bfloat16"
    for options, message in ((dict(batch_size=0), "--batch-size must be a positive integer"),
                             (dict(retries=-1), "--retries must be an integer >= 0"),
                             (dict(samples_per_shard=True), "--samples-per-shard"),
                             (dict(store_format="hdf5"), "--store-format 'hdf5'"),
                             (dict(store_dtype="int4"), "--store-dtype 'int4'"),
                             (dict(mode="append"), "mode 'append'"),
                             (dict(store_format="safetensors", codec="zstd"), "--codec: .*raw bytes"),
                             (dict(dask="local:2", part=Part(0, 2, lambda: None)), "--dask: under data parallelism")):
        with pytest.raises(preinfer.errors.UsageError, match=message):
            CacheOptions(**options)
    with pytest.raises(preinfer.errors.UsageError, match="part 2 of 2"):
        Part(2, 2, lambda: None)
    resolved = CacheOptions().for_model(torch.float32, "cpu")
    assert (resolved.store_dtype, resolved.dtype, resolved.device) == ("float32", torch.float32, "cpu")
