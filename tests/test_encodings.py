"""Lossy store encodings (float8_e4m3, float8_e5m2, int8 with a per-token scale): the codec's error bound on
random and adversarial rows, stores that encode on write and decode on read, the error recorded per shard and
shown by inspect, non-finite states refused, and a split opened whole by zarr and xarray."""

import json
import re

import numpy as np
import pytest
import torch
import zarr

import storage
from pipelines.cache import roll_forward
from pipelines.cache.report import verify_cache
from pipelines.cache.result import CacheJobError
from pipelines.cache.shards import NonFiniteStates, write_shard
from preinfer.memory.settings import Settings
from preinfer.memory.shapes import shape_for_size
from preinfer.memory.traffic import COMPRESSION, store_bytes_per_token
from preinfer.memory.traffic import STORE_DTYPES as PLAN_STORE_DTYPES
from storage import ENCODINGS, StorageError, create_store, open_store
from storage.encodings import merge_stats
from tests.helpers.cache_jobs import SEQ, cache, datasets_for, staged_model
from tests.helpers.cli_run import run_cli
from tests.helpers.corpus_samples import write_corpus

LOSSY = list(ENCODINGS)
TINY = float(np.nextafter(np.float32(0), np.float32(1)))  # float32's smallest subnormal


def assert_within_bound(encoding, x: torch.Tensor) -> None:
    """Every decoded element within bound x its row's scale."""
    codes, scale = encoding.encode(x)
    decoded = encoding.decode(codes, scale)
    assert codes.dtype == encoding.code_dtype and scale.dtype == torch.float32 and scale.shape == x.shape[:-1]
    assert bool(torch.isfinite(decoded).all()) and bool((scale > 0).all())
    error = (decoded.double() - x.double()).abs()
    allowed = encoding.bound * scale.double().unsqueeze(-1)
    assert bool((error <= allowed).all()), float((error / allowed).max())
    # the scale is no larger than it needs to be (one float32 step above max|x| / max_code)
    absmax = x.double().abs().amax(-1)
    assert bool((scale.double() <= torch.clamp(absmax / encoding.max_code * (1 + 2**-22), min=TINY) + TINY).all())


@pytest.mark.parametrize("name", LOSSY)
def test_random_rows_decode_within_the_bound(name):
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(64, 16, 96, generator=generator) * torch.logspace(-3, 3, 16)[None, :, None]
    assert_within_bound(ENCODINGS[name], x)
    assert_within_bound(ENCODINGS[name], x.to(torch.bfloat16))


@pytest.mark.parametrize("name", LOSSY)
def test_adversarial_rows_decode_within_the_bound(name):
    encoding = ENCODINGS[name]
    rows = torch.randn(6, 32, generator=torch.Generator().manual_seed(1))
    rows[0] = 0.0  # all zero
    rows[1, 5] = 1e30  # one huge outlier among values near 1
    rows[2] = rows[2] * 1e-40  # scale subnormal
    rows[3] = 0.0
    rows[3, 7] = TINY  # the smallest positive float32 alone
    rows[4] = rows[4] * 3e-43  # a few subnormal units: the scale rounds to a handful of them
    rows[5] = 1e38 * torch.sign(rows[5])  # every element near float32's largest
    assert_within_bound(encoding, rows)
    codes, scale = encoding.encode(rows)
    decoded = encoding.decode(codes, scale)
    assert bool((decoded[0] == 0).all()) and float(decoded[1, 5]) == pytest.approx(1e30, rel=2**-3)


@pytest.mark.parametrize("name", LOSSY)
def test_decoding_is_each_code_times_its_rows_scale(name):
    encoding = ENCODINGS[name]
    codes = torch.arange(256, dtype=torch.uint8).view(encoding.code_dtype).repeat(3, 1)  # every bit pattern
    scale = torch.tensor([1.0, 3.7e-3, TINY])
    expected = codes.float() * scale[:, None]  # torch's own conversion of the codes
    for dtype in (torch.float32, torch.bfloat16):
        decoded = encoding.decode(codes, scale, dtype)
        assert decoded.dtype == dtype
        assert torch.equal(decoded.isnan(), expected.isnan())
        assert torch.equal(torch.nan_to_num(decoded), torch.nan_to_num(expected.to(dtype)))


def test_the_measured_error_is_what_the_formats_promise():
    x = torch.randn(32, 64, 256, generator=torch.Generator().manual_seed(2))
    rms = {}
    for name, encoding in ENCODINGS.items():
        codes, scale = encoding.encode(x)
        stats = merge_stats([storage.encodings.error_stats(x, encoding.decode(codes, scale), scale,
                                                                     encoding.bound)])
        assert 0 < stats["max_over_bound"] <= 1 and stats["max_abs"] > 0
        rms[name] = stats["rms_rel"]
    # e4m3 keeps 3 mantissa bits (~2% relative RMS), e5m2 2 bits; int8 with a per-row absmax loses small values
    assert rms["float8_e4m3"] < 0.03 and rms["float8_e5m2"] < 0.06 and rms["int8"] < 0.03
    assert rms["float8_e4m3"] < rms["float8_e5m2"]


def fields(dtype: str) -> dict:
    return {"hidden": ((4, 8), dtype), "labels": ((4,), torch.int64)}


@pytest.mark.parametrize("format", ["zarr", "safetensors", "memory"])
@pytest.mark.parametrize("name", LOSSY)
def test_a_lossy_store_encodes_on_write_and_decodes_on_read(tmp_path, format, name):
    path = str(tmp_path / f"{format}-{name}") if format != "memory" else f"lossy-{format}-{name}-{tmp_path.name}"
    store = create_store(path, fields(name), 10, 4, "fp", format=format, overwrite=True)
    assert store.fields["hidden_scale"].shape == (4,) and store.manifest["encodings"]["hidden"]["codes"] == name
    x = torch.randn(10, 4, 8, generator=torch.Generator().manual_seed(3), dtype=torch.float32)
    labels = torch.arange(40).reshape(10, 4)
    for i in range(store.num_shards):
        lo, hi = store.shard_range(i)
        store.write_shard(i, {"hidden": x[lo:hi], "labels": labels[lo:hi]})
    store.write_shard(0, {"hidden": x[:4], "labels": labels[:4]})  # identical content: a no-op
    store.finalize()
    store = open_store(path)
    raw = store.read_shard(1)
    assert raw["hidden"].dtype == ENCODINGS[name].code_dtype and raw["hidden_scale"].dtype == torch.float32
    decoded = store.decode(raw, torch.float32)
    assert set(decoded) == {"hidden", "labels"} and torch.equal(decoded["labels"], labels[4:8])
    bound = ENCODINGS[name].bound * raw["hidden_scale"].unsqueeze(-1) * (1 + 1e-6)
    assert bool(((decoded["hidden"] - x[4:8]).abs() <= bound).all())
    errors = store.encoding_error()["hidden"]
    per_shard = [store.manifest["shards"][str(i)]["encoding_error"]["hidden"] for i in range(store.num_shards)]
    assert errors == merge_stats(per_shard) and 0 < errors["max_over_bound"] <= 1
    batches = list(store.reader(3, shuffle=False, decode=torch.bfloat16))
    assert set(batches[0]) == {"hidden", "labels"} and batches[0]["hidden"].dtype == torch.bfloat16
    assert torch.equal(torch.cat([b["hidden"] for b in batches]),
                       torch.cat([store.decode(store.read_shard(i), torch.bfloat16)["hidden"] for i in range(3)]))
    assert set(next(iter(store.reader(3, fields=["hidden"], decode=torch.float32)))) == {"hidden"}


@pytest.mark.parametrize("name", LOSSY)
def test_a_lossy_store_refuses_non_finite_states_naming_the_samples(tmp_path, name):
    store = create_store(tmp_path / "s", fields(name), 8, 8, "fp")
    x = torch.randn(8, 4, 8)
    x[2, 1, 3], x[5, 0, 0] = float("nan"), float("-inf")
    with pytest.raises(StorageError, match=r"shard 0 \(samples 0..8\).*NaN or inf.*\(samples 2, 5\)"):
        store.write_shard(0, {"hidden": x, "labels": torch.zeros(8, 4, dtype=torch.int64)})
    assert store.missing_shards() == [0]


def test_a_lossy_store_refuses_values_whose_decoding_would_overflow(tmp_path):
    store = create_store(tmp_path / "s", fields("int8"), 8, 8, "fp")
    x = torch.ones(8, 4, 8)
    x[6, 2] = torch.finfo(torch.float32).max  # max / 127 rounds up: 127 * scale overflows float32
    with pytest.raises(StorageError, match=r"too close to float32's largest.*\(samples 6\)"):
        store.write_shard(0, {"hidden": x, "labels": torch.zeros(8, 4, dtype=torch.int64)})
    assert store.missing_shards() == [0]


def test_a_lossy_field_needs_a_float_tensor_and_keeps_its_scale_name(tmp_path):
    store = create_store(tmp_path / "s", fields("int8"), 4, 4, "fp")
    with pytest.raises(StorageError, match="floating dtype"):
        store.write_shard(0, {"hidden": torch.zeros(4, 4, 8, dtype=torch.int64), "labels": torch.zeros(4, 4).long()})
    with pytest.raises(StorageError, match="hidden_scale"):
        create_store(tmp_path / "t", {**fields("int8"), "hidden_scale": ((3,), torch.float32)}, 4, 4, "fp")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_the_caching_job_refuses_non_finite_states_for_every_dtype(tmp_path, dtype):
    store = create_store(tmp_path / dtype, {"hidden": ((4, 8), dtype)}, 8, 4, "fp")
    x = torch.ones(4, 4, 8, dtype=getattr(torch, dtype))
    x[3, 2, 1] = float("inf")
    with pytest.raises(NonFiniteStates, match=r"train shard 1 \(samples 4..8\).*samples 7 hold NaN or inf"):
        write_shard(store, "train", 1, {"hidden": x}, retries=2)
    assert store.missing_shards() == [0, 1]


def test_a_diverged_prefix_is_refused_by_the_caching_job(tmp_path, corpus):
    staged = staged_model()
    with torch.no_grad():
        next(staged.model.parameters()).fill_(float("nan"))
    with pytest.raises(CacheJobError, match=r"hold NaN or inf"):
        cache(staged, {"eval": datasets_for(corpus)["eval"]}, 1, tmp_path / "c", store_dtype="bfloat16")
    assert open_store(tmp_path / "c" / "eval", check_files=False).completed_shards() == []


@pytest.fixture(scope="module")
def lossy_cache(tmp_path_factory):
    """(corpus, cache directory) of tiny-llama at boundary 2 in float8_e4m3."""
    root = tmp_path_factory.mktemp("lossy")
    corpus = write_corpus(root / "corpus.txt")
    cache(staged_model(), datasets_for(corpus), 2, root / "c", store_dtype="float8_e4m3")
    return corpus, root / "c"


def test_inspect_json_parses_and_matches_the_plain_output(lossy_cache, capsys):
    _, out = lossy_cache
    code, text, err = run_cli(["inspect", str(out / "train")], capsys)
    assert code == 0, err
    code, raw, err = run_cli(["inspect", str(out / "train"), "--json"], capsys)
    info = json.loads(raw)
    hidden = info["encodings"]["hidden"]
    assert code == 0 and info["status"] == "complete" and hidden["codes"] == "float8_e4m3"
    assert f"status        {info['status']}" in text
    assert f"{info['samples']:,} of {info['seq_len']} tokens, in {info['shards']} shards" in text
    assert f"relative RMS error {hidden['rms_rel']:.4g}, max abs error {hidden['max_abs']:.4g}" in text
    assert f"({hidden['max_over_bound']:.3f} of the bound)" in text and 0 < hidden["rms_rel"] < 0.05
    assert "hidden [32, 64] float8_e4m3" in text and "hidden_scale [32] float32" in text
    assert f"{info['raw_bytes'] / 2**20:,.1f} MiB raw" in text and info["fingerprint"]["digest"] in text
    both = json.loads(run_cli(["inspect", str(out), "--json"], capsys)[1])
    assert [s["split"] for s in both] == ["eval", "train"] or [s["split"] for s in both] == ["train", "eval"]


def test_verify_recomputes_a_lossy_store_within_its_bound(lossy_cache):
    corpus, out = lossy_cache
    staged, data = staged_model(), datasets_for(corpus)
    from pipelines.data.tokenizers import load_tokenizer

    checks = verify_cache(out, staged, data, load_tokenizer("byte"), samples=4)
    assert all(c.ok for c in checks), "\n".join(map(str, checks))
    assert all(c.max_abs_diff > 0 and c.bit_exact == 0 for c in checks)
    store = open_store(out / "train")
    shard = store.read_shard(0)
    shard["hidden_scale"] = shard["hidden_scale"] * 1.5  # what decoding would give if the scales were off
    from pipelines.cache import report

    check = report.StoreCheck("train", str(out), "", True)
    with torch.inference_mode():
        fresh = staged.run(report.DatasetInputs(staged, data["train"], "cpu")(0, 1), 0, 2).to_dict()
    stored = {k: v[:1] for k, v in shard.items()}
    allowance = report._encoding_allowance(store, {k: v[:1] for k, v in store.read_shard(0).items()})
    report._compare(check, 0, store.decode(stored, torch.float32), fresh, torch.float32, allowance)
    assert check.mismatches and "hidden states differ" in check.mismatches[0]


def test_roll_forward_from_a_lossy_store_reads_decoded_states(lossy_cache, tmp_path):
    _, out = lossy_cache
    staged = staged_model()
    result = roll_forward(staged, out, 3, tmp_path / "k3", splits=["eval"],
                          options=__import__("pipelines.cache", fromlist=["CacheOptions"]).CacheOptions(
                              samples_per_shard=16, batch_size=6, progress=False, model_name="tiny-llama",
                              store_dtype="float8_e4m3"))
    rolled = open_store(tmp_path / "k3" / "eval")
    source = open_store(out / "eval")
    decoded = source.decode(source.read_shard(0), torch.float32)
    from preinfer.boundary_state import BoundaryState

    with torch.inference_mode():
        expected = staged.run(BoundaryState.from_dict(decoded), 2, 3).hidden
    got = rolled.decode(rolled.read_shard(0), torch.float32)["hidden"]
    bound = ENCODINGS["float8_e4m3"].bound * rolled.read_shard(0)["hidden_scale"].unsqueeze(-1)
    assert result.boundary == 3 and bool(((got - expected[: len(got)]).abs() <= bound * (1 + 1e-5) + 1e-5).all())


@pytest.mark.slow
def test_a_split_is_one_zarr_group_and_one_xarray_dataset(lossy_cache, tmp_path):
    xarray = pytest.importorskip("xarray")
    _, out = lossy_cache
    store = open_store(out / "train")
    group = zarr.open_group(str(out / "train" / "data"), mode="r")
    assert set(group.array_keys()) == set(store.fields)
    assert group["hidden"].metadata.dimension_names == ("sample", "token", "hidden_dim")
    assert group["hidden"].attrs["encoding"]["scale"] == "hidden_scale"
    ds = xarray.open_zarr(str(out / "train" / "data"), consolidated=False)
    assert dict(ds.sizes) == {"sample": store.num_samples, "token": SEQ, "hidden_dim": 64}
    first = store.read_shard(0)
    n = len(first["hidden"])
    codes = torch.from_numpy(ds["hidden"].values[:n]).view(torch.float8_e4m3fn)
    assert torch.equal(codes.view(torch.uint8), first["hidden"].view(torch.uint8))
    assert torch.equal(torch.from_numpy(ds["hidden_scale"].values[:n]), first["hidden_scale"])
    assert np.array_equal(ds["labels"].values[:n], first["labels"].numpy())
    # an exact bfloat16 store: its uint16 bit patterns and the dtype attribute
    staged, corpus = staged_model(), write_corpus(tmp_path / "corpus.txt")
    cache(staged, {"eval": datasets_for(corpus)["eval"]}, 1, tmp_path / "bf", store_dtype="bfloat16")
    bf = open_store(tmp_path / "bf" / "eval")
    ds = xarray.open_zarr(str(tmp_path / "bf" / "eval" / "data"), consolidated=False)
    assert ds["hidden"].attrs["dtype"] == "bfloat16" and ds["hidden"].dtype == np.uint16
    stored = torch.cat([bf.read_shard(i)["hidden"] for i in range(bf.num_shards)])
    assert torch.equal(torch.from_numpy(ds["hidden"].values).view(torch.bfloat16), stored)


def test_bytes_per_token_is_the_same_for_the_planner_and_the_store():
    shape = shape_for_size("7b")
    assert set(PLAN_STORE_DTYPES) == {"float32", "bfloat16", "float16", *LOSSY}
    for name in PLAN_STORE_DTYPES:
        settings = Settings(dtype="bf16-mixed", store_dtype=name, compression=1.0)
        assert store_bytes_per_token(shape, settings) == storage.bytes_per_token(name, 4096)
    assert storage.bytes_per_token("float8_e4m3", 4096) == 4100 and storage.bytes_per_token("bfloat16", 4096) == 8192


def test_plan_reports_the_bytes_of_the_store_dtype(capsys):
    sizes = {}
    for name in ("bfloat16", "float8_e4m3"):
        code, text, err = run_cli(["plan", "--model", "7b", "--dtype", "bf16-mixed", "--store-dtype", name,
                                   "--tokens", "1e9", "--json"], capsys)
        assert code == 0, err
        sizes[name] = json.loads(text)["store"]
    for name, size in sizes.items():
        assert size["dtype"] == name
        assert size["bytes_per_token"] == pytest.approx(storage.bytes_per_token(name, 4096) / COMPRESSION[name])
        assert size["bytes_per_boundary"] == pytest.approx(size["bytes_per_token"] * 1e9)
    code, _, err = run_cli(["plan", "--model", "7b", "--store-dtype", "int4"], capsys)
    assert code == 2 and re.search(r"--store-dtype", err)


def test_verify_reports_a_shard_whose_recorded_error_exceeds_the_bound(tmp_path):
    store = create_store(tmp_path / "s", fields("float8_e4m3"), 8, 4, "fp")
    for i in range(2):
        store.write_shard(i, {"hidden": torch.randn(4, 4, 8), "labels": torch.zeros(4, 4, dtype=torch.int64)})
    store.finalize()
    assert storage.verify(tmp_path / "s").ok
    manifest = json.loads((tmp_path / "s" / "manifest.json").read_text())
    manifest["shards"]["1"]["encoding_error"]["hidden"]["max_over_bound"] = 1.5
    (tmp_path / "s" / "manifest.json").write_text(json.dumps(manifest))
    report = storage.verify(tmp_path / "s")
    assert not report.ok and [p.shard for p in report.bad] == [1] and "1.5 x its bound" in str(report)


@pytest.mark.slow
def test_train_from_a_lossy_cache_reads_decoded_states(lossy_cache, tmp_path, capsys):
    _, out = lossy_cache
    code, _, err = run_cli(["train", "--store", str(out), "--model", "tiny-llama", "--out",
                            str(tmp_path / "run"), "--steps-per-visit", "2", "--batch-size", "4", "--blocks", "1"], capsys)
    assert code == 0, err
    losses = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert any(r.get("kind") == "visit" and 0 < r["eval_loss"] < 10 for r in losses)


@pytest.mark.slow
def test_bcd_builds_and_rolls_forward_lossy_stores(tmp_path, corpus, pinned_rates):
    """With pre-inference on, the stores of an ascending sweep are made from the input, then rolled forward (a
    layer's forward pinned slow enough against the disk for that to be the cheaper way), in float8."""
    from pipelines import training
    from tests.helpers.training_runs import cache_records, config_for

    exact = training.run(config_for(tmp_path, corpus, "exact", mode="on"), quiet=True)
    config = config_for(tmp_path, corpus, "lossy", mode="on", store_dtype="float8_e4m3", keep_stores=True)
    lossy = training.run(config, quiet=True)
    hows = [r.how for r in cache_records(config.run.out)]
    assert "input" in hows and "roll_forward" in hows
    stores = [open_store(p.parent) for p in (tmp_path / "lossy").rglob("manifest.json")]
    assert stores and all(s.fields["hidden"].dtype == "float8_e4m3" and s.encoding_error()["hidden"]["rms_rel"] > 0
                          for s in stores)
    assert lossy["final_eval_loss"] == pytest.approx(exact["final_eval_loss"], rel=0.05)
