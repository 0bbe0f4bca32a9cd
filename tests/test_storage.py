"""Store round trips, writing rules, integrity errors, fingerprints and format versions (issue 3)."""

from __future__ import annotations

import json
import pathlib
import re
import uuid

import pytest
import torch

import storage
from storage import (
    Fingerprint,
    LayoutMismatchError,
    StaleStoreError,
    StorageError,
    Store,
    create_store,
    open_store,
    verify,
)
from storage.blobs import Blobs, MemoryBlobs
from storage.errors import CorruptStoreError, IncompleteStoreError, UnsupportedFormatError
from storage.manifest import FORMAT_VERSION
from storage.memory_backend import MemoryStore
from storage.safetensors_backend import SafetensorsStore
from storage.zarr_backend import ZarrStore

FP = Fingerprint("digest-a", {"model": "tiny-llama", "boundary": 2, "dataset": "topics", "seq_len": 8})
ALL_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.int32, torch.int64, torch.bool]
# (backend, codec) pairs; every zarr codec goes through the same checks.
VARIANTS = [("zarr", None), ("zarr", "zstd"), ("zarr", "none"), ("zarr", "blosc-lz4"), ("safetensors", None), ("memory", None)]
BITS = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}


def bf16_specials() -> torch.Tensor:
    """bf16 NaN (quiet, signalling, negative), +-inf, +-0, smallest/largest subnormals, +-max, smallest normal."""
    bits = [0x7FC0, 0x7F81, 0xFFC1, 0x7F80, 0xFF80, 0x0000, 0x8000, 0x0001, 0x007F, 0x8001, 0x7F7F, 0xFF7F, 0x0080]
    return torch.tensor(bits, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)


def random_field(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """Every bit pattern is fair game for floats (NaN payloads, subnormals, inf); random values otherwise."""
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool()
    if dtype in BITS:
        info = torch.iinfo(BITS[dtype])
        return torch.randint(info.min, info.max, shape, generator=gen, dtype=BITS[dtype]).view(dtype)
    return torch.randint(-(2**30), 2**30, shape, generator=gen, dtype=dtype)


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-for-bit equality, NaN payloads included."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.view(BITS[a.dtype]), b.view(BITS[b.dtype])) if a.dtype in BITS else torch.equal(a, b)


def make_path(tmp_path: pathlib.Path, backend: str, where: str = "local") -> str:
    if backend == "memory":
        return f"mem-{uuid.uuid4().hex}"
    return f"memory://storage-tests/{uuid.uuid4().hex}" if where == "url" else str(tmp_path / "store")


def shard_data(store: storage.Store, i: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Deterministic content of shard i (bf16 fields carry the special values first)."""
    start, stop = store.shard_range(i)
    gen = torch.Generator().manual_seed(seed * 1000 + i)
    data = {name: random_field((stop - start, *spec.shape), storage.dtypes.torch_dtype(spec.dtype), gen)
            for name, spec in store.fields.items()}
    if "bf16" in data:
        flat = data["bf16"].view(-1)
        flat[: len(bf16_specials())] = bf16_specials()
    if "index" in data:
        data["index"] = torch.arange(start, stop)
    return data


def fill(store: storage.Store, shards=None, seed: int = 0) -> None:
    for i in range(store.num_shards) if shards is None else shards:
        store.write_shard(i, shard_data(store, i, seed))


def small_store(path: str, backend: str = "zarr", codec=None, num_samples: int = 10, **kw) -> storage.Store:
    fields = {"hidden": ((3, 8), torch.bfloat16), "index": ((), torch.int64), "mask": ((3,), torch.bool)}
    return create_store(path, fields=fields, num_samples=num_samples, samples_per_shard=4, fingerprint=FP,
                        format=backend, codec=codec, **kw)


@pytest.mark.parametrize("backend,codec", VARIANTS)
def test_round_trip_bit_exact_every_dtype(tmp_path, backend, codec):
    fields = {name: ((3, 5), dtype) for name, dtype in zip(["f32", "f16", "bf16", "i32", "i64", "b"], ALL_DTYPES)}
    path = make_path(tmp_path, backend)
    store = create_store(path, fields=fields, num_samples=11, samples_per_shard=4, fingerprint=FP,
                         format=backend, codec=codec)
    assert (store.num_shards, store.shard_range(2)) == (3, (8, 11))  # last shard holds fewer samples
    fill(store)
    store.finalize()
    reopened = open_store(path, expect_fingerprint=FP)
    for i in range(3):
        expected, got = shard_data(store, i), reopened.read_shard(i)
        assert set(got) == set(fields)
        for name in fields:
            assert bits_equal(got[name], expected[name]), (backend, codec, name, i)
    assert bits_equal(reopened.read_shard(0)["bf16"].view(-1)[:13], bf16_specials())
    assert verify(path).ok


@pytest.mark.parametrize("backend", ["zarr", "safetensors"])
def test_fsspec_memory_url_round_trip(tmp_path, backend):
    path = make_path(tmp_path, backend, "url")
    store = small_store(path, backend)
    fill(store)
    store.finalize()
    got = open_store(path, expect_fingerprint="digest-a").read_shard(1)
    assert all(bits_equal(got[k], v) for k, v in shard_data(store, 1).items())
    assert verify(path).ok


def test_store_description(tmp_path):
    store = small_store(str(tmp_path / "s"))
    assert (store.num_samples, store.samples_per_shard, store.num_shards) == (10, 4, 3)
    assert store.fields["hidden"] == storage.FieldSpec((3, 8), "bfloat16")
    assert store.fingerprint == FP and store.path == str(tmp_path / "s")
    manifest = store.manifest
    assert manifest["format_version"] == FORMAT_VERSION and manifest["backend"] == "zarr"
    assert manifest["codec"] == {"name": "blosc-zstd", "level": 1, "shuffle": "byte", "blocksize": 1 << 20}
    fill(store)
    store.finalize()
    info = open_store(tmp_path / "s").size_info()
    assert info["raw_bytes"] == 10 * (3 * 8 * 2 + 8 + 3) and info["stored_bytes"] > 0
    done = json.loads((tmp_path / "s" / "manifest.json").read_text())
    assert done["complete"] and set(done["shards"]) == {"0", "1", "2"}
    assert done["shards"]["2"]["samples"] == [8, 10]


def test_zarr_layout_and_attributes(tmp_path):
    import zarr

    store = small_store(str(tmp_path / "s"))
    fill(store)
    array = zarr.open_array(str(tmp_path / "s" / "data"), path="hidden", mode="r")
    assert array.dtype == "uint16" and array.attrs["dtype"] == "bfloat16"
    codecs = array.metadata.to_dict()["codecs"][0]
    assert codecs["name"] == "sharding_indexed" and codecs["configuration"]["chunk_shape"][0] == 4
    inner = [c["name"] for c in codecs["configuration"]["codecs"]]
    assert inner == ["bytes", "blosc", "crc32c"]


def test_safetensors_index_written_at_finalize(tmp_path):
    store = small_store(str(tmp_path / "s"), "safetensors")
    fill(store)
    store.finalize()
    index = json.loads((tmp_path / "s" / "shards.safetensors.index.json").read_text())
    assert list(index["shards"]) == [f"shard-00000{i}.safetensors" for i in range(3)]
    assert index["shards"]["shard-000002.safetensors"]["samples"] == [8, 10]
    assert all(len(s["crc32c"]) == 8 for s in index["shards"].values())


@pytest.mark.parametrize("backend", ["zarr", "safetensors", "memory"])
def test_write_errors_are_clear(tmp_path, backend):
    store = small_store(make_path(tmp_path, backend), backend)
    good = shard_data(store, 0)
    with pytest.raises(StorageError, match=r"shard index 3 out of range; it has shards 0\.\.2"):
        store.write_shard(3, good)
    with pytest.raises(StorageError, match=r"field 'hidden' must have shape \[4, 3, 8\] and dtype bfloat16, got shape \[4, 3, 7\]"):
        store.write_shard(0, {**good, "hidden": good["hidden"][..., :7]})
    with pytest.raises(StorageError, match=r"dtype bfloat16, got shape \[4, 3, 8\] and dtype float32"):
        store.write_shard(0, {**good, "hidden": good["hidden"].float()})
    with pytest.raises(StorageError, match=r"expected exactly the fields \['hidden', 'index', 'mask'\]"):
        store.write_shard(0, {"hidden": good["hidden"]})
    with pytest.raises(StorageError, match="unsupported dtype"):
        create_store(make_path(tmp_path, backend) + "x", fields={"a": ((2,), torch.complex64)}, num_samples=4,
                     samples_per_shard=2, fingerprint=FP, format=backend)
    assert store.missing_shards() == [0, 1, 2]


@pytest.mark.parametrize("backend", ["zarr", "safetensors", "memory"])
def test_rewrite_identical_is_noop_different_refused(tmp_path, backend):
    store = small_store(make_path(tmp_path, backend), backend)
    fill(store, [1])
    store.write_shard(1, shard_data(store, 1))
    with pytest.raises(StorageError, match=r"shard 1 \(samples 4\.\.8\) is already complete with different content"):
        store.write_shard(1, shard_data(store, 1, seed=7))
    assert store.missing_shards() == [0, 2]


def test_second_writer_on_one_shard_refused(tmp_path):
    store = small_store(str(tmp_path / "s"))
    with store._blobs.lock("shard-000001"):
        with pytest.raises(StorageError, match="'shard-000001' is being written by another writer"):
            store.write_shard(1, shard_data(store, 1))
    store.write_shard(1, shard_data(store, 1))


@pytest.mark.parametrize("backend", ["zarr", "safetensors", "memory"])
def test_incomplete_store_resumes_but_does_not_read(tmp_path, backend):
    path = make_path(tmp_path, backend)
    store = small_store(path, backend, num_samples=30)
    fill(store, [0, 2, 3, 7])
    reopened = open_store(path)
    assert reopened.missing_shards() == [1, 4, 5, 6]
    with pytest.raises(IncompleteStoreError, match=r"4 of 8 shards are not written \(shards 1, 4-6\)"):
        reopened.finalize()
    with pytest.raises(IncompleteStoreError, match=r"shards 1, 4-6"):
        reopened.reader(batch_size=4)
    with pytest.raises(IncompleteStoreError, match=r"shard 5 \(samples 20\.\.24\) is not written yet"):
        reopened.read_shard(5)
    fill(reopened, reopened.missing_shards())
    reopened.finalize()
    assert verify(path).ok and not open_store(path).missing_shards()


def test_create_store_resumes_identical_refuses_different(tmp_path):
    path = str(tmp_path / "s")
    fill(small_store(path), [0])
    again = small_store(path)
    assert again.missing_shards() == [1, 2]
    with pytest.raises(StorageError, match="a different store exists .* pass overwrite=True"):
        small_store(path, codec="none")
    fresh = small_store(path, codec="none", overwrite=True)
    assert fresh.missing_shards() == [0, 1, 2] and fresh.codec["name"] == "none"
    foreign = tmp_path / "notastore"
    foreign.mkdir()
    (foreign / "precious.txt").write_text("keep me")
    with pytest.raises(StorageError, match="not an activation store .* nothing was deleted"):
        small_store(str(foreign), overwrite=True)
    assert (foreign / "precious.txt").exists()


def test_reopening_another_store_says_what_differs(tmp_path):
    path = str(tmp_path / "s")
    small_store(path)
    with pytest.raises(LayoutMismatchError) as caught:
        create_store(path, fields={"hidden": ((3, 9), torch.bfloat16), "index": ((), torch.int64),
                                   "mask": ((3,), torch.bool)}, num_samples=12, samples_per_shard=4, fingerprint=FP)
    assert caught.value.differences == {
        "num_samples": (10, 12), "field hidden": ({"shape": [3, 8], "dtype": "bfloat16"},
                                                 {"shape": [3, 9], "dtype": "bfloat16"})}
    with pytest.raises(LayoutMismatchError) as caught:
        small_store(path, backend="safetensors")
    assert set(caught.value.differences) == {"format", "codec"}
    assert caught.value.differences["format"] == ("zarr", "safetensors")
    other = Fingerprint("digest-b", {**FP.parts, "boundary": 3})
    with pytest.raises(StaleStoreError, match=r"a different store exists .*boundary: store has 2, expected 3"):
        create_store(path, fields={"index": ((), torch.int64)}, num_samples=10, samples_per_shard=4,
                     fingerprint=other)
    assert storage.is_store(path) and not storage.is_store(tmp_path)


def store_files(path: str) -> list[str]:
    return sorted(p.relative_to(path).as_posix() for p in pathlib.Path(path).rglob("*") if p.is_file())


@pytest.mark.parametrize("backend", ["zarr", "safetensors"])
def test_a_finished_store_holds_its_data_files_and_manifest_only(tmp_path, backend):
    if backend == "zarr":
        expected = ["data/zarr.json", *(f"data/{name}/zarr.json" for name in ("hidden", "index", "mask"))]
        expected += [key for i in range(3) for key in (f"data/hidden/c/{i}/0/0", f"data/index/c/{i}",
                                                         f"data/mask/c/{i}/0")]
    else:
        expected = ["shards.safetensors.index.json", *(f"shards/shard-{i:06d}.safetensors" for i in range(3))]
    expected = sorted([*expected, "manifest.json"])
    path = str(tmp_path / "s")
    killed = small_store(path, backend)
    fill(killed, [0, 2])  # a writer that died here leaves a completion record and a lock file per shard
    left = store_files(path)
    assert {"done/shard-000000.json", "done/shard-000002.json"} <= set(left)
    assert "locks/shard-000000.lock" in left
    resumed = small_store(path, backend)
    assert resumed.missing_shards() == [1]
    fill(resumed, [1])
    resumed.finalize()
    assert store_files(path) == expected
    assert verify(path).ok and open_store(path).shard_bytes(1) > 0
    assert [open_store(path).read_shard(i)["index"].tolist() for i in range(3)] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    path, _ = finished(tmp_path / "again", backend)
    assert store_files(path) == expected


def test_bad_arguments(tmp_path):
    with pytest.raises(StorageError, match="unknown backend 'hdf5'"):
        small_store(str(tmp_path / "a"), backend="hdf5")
    with pytest.raises(StorageError, match="codec must be 'none'"):
        small_store(str(tmp_path / "b"), backend="safetensors", codec="zstd")
    with pytest.raises(StorageError, match="unknown codec 'lzma'"):
        small_store(str(tmp_path / "c"), codec="lzma")
    with pytest.raises(StorageError, match="no activation store at"):
        open_store(tmp_path / "nothing")


# ---- integrity -------------------------------------------------------------------------------------------------
def finished(tmp_path, backend="zarr", codec=None) -> tuple[str, storage.Store]:
    path = str(tmp_path / "s")
    store = small_store(path, backend, codec)
    fill(store)
    store.finalize()
    return path, store


def shard_file(path: str, backend: str, shard: int) -> pathlib.Path:
    if backend == "zarr":
        return pathlib.Path(path, "data", "hidden", "c", str(shard), "0", "0")
    return pathlib.Path(path, "shards", f"shard-{shard:06d}.safetensors")


@pytest.mark.parametrize("backend,codec", [("zarr", None), ("zarr", "none"), ("safetensors", None)])
@pytest.mark.parametrize("offset", [40, -10])  # inside a chunk's data, inside the shard index / file tail
def test_flipped_byte_is_caught(tmp_path, backend, codec, offset):
    path, _ = finished(tmp_path, backend, codec)
    target = shard_file(path, backend, 1)
    raw = bytearray(target.read_bytes())
    raw[offset] ^= 0x10
    target.write_bytes(bytes(raw))
    store = open_store(path)  # sizes are unchanged: only the checksums can tell
    with pytest.raises(CorruptStoreError, match=r"shard 1 \(samples 4\.\.8\) is corrupt"):
        store.read_shard(1)
    assert store.read_shard(0) and store.read_shard(2)
    report = verify(path)
    assert not report.ok and [p.shard for p in report.bad] == [1] and report.bad[0].samples == (4, 8)
    assert "shard 1 (samples 4..8)" in str(report)


@pytest.mark.parametrize("backend", ["zarr", "safetensors"])
def test_deleted_shard_file_reported(tmp_path, backend):
    path, _ = finished(tmp_path, backend)
    shard_file(path, backend, 2).unlink()
    with pytest.raises(CorruptStoreError, match=r"1 damaged shards \(2\).*shard 2: file .* is missing"):
        open_store(path)
    report = verify(path)
    assert [(p.shard, p.samples) for p in report.bad] == [(2, (8, 10))] and "is missing" in report.bad[0].problem
    with pytest.raises(CorruptStoreError, match=r"shard 2 \(samples 8\.\.10\) is corrupt: file .* is missing"):
        open_store(path, check_files=False).read_shard(2)


@pytest.mark.parametrize("backend", ["zarr", "safetensors"])
def test_truncated_shard_file_reported(tmp_path, backend):
    path, _ = finished(tmp_path, backend)
    target = shard_file(path, backend, 0)
    target.write_bytes(target.read_bytes()[:-30])
    with pytest.raises(CorruptStoreError, match=r"shard 0: file .* has \d+ bytes, expected \d+ \(truncated"):
        open_store(path)
    assert [p.shard for p in verify(path).bad] == [0]


def test_missing_zarr_array_metadata_reported(tmp_path):
    path, _ = finished(tmp_path)
    pathlib.Path(path, "data", "mask", "zarr.json").unlink()
    with pytest.raises(CorruptStoreError, match=r"zarr array of field 'mask' .* is missing or unreadable"):
        open_store(path)
    assert "zarr array of field 'mask'" in verify(path).manifest_error


@pytest.mark.parametrize("damage", ["truncate", "garble", "empty", "not-a-manifest", "inconsistent"])
def test_bad_manifest_is_a_clear_error(tmp_path, damage):
    path, _ = finished(tmp_path)
    manifest = pathlib.Path(path, "manifest.json")
    text = manifest.read_text()
    assert '"num_shards": 3' in text
    manifest.write_text({"truncate": text[: len(text) // 2], "garble": text.replace('"fields"', '"fieldz"'),
                         "empty": "", "not-a-manifest": "[1, 2]",
                         "inconsistent": text.replace('"num_shards": 3', '"num_shards": 4')}[damage])
    with pytest.raises(CorruptStoreError, match=r"manifest\.json (is not valid JSON .* truncated or garbled|is garbled|is not a preinfer)"):
        open_store(path)
    report = verify(path)
    assert not report.ok and "manifest.json" in report.manifest_error and "BAD manifest" in str(report)


def test_fingerprint_mismatch_names_the_parts(tmp_path):
    path, _ = finished(tmp_path)
    other = Fingerprint("digest-b", {**FP.parts, "boundary": 3, "dataset": "wiki"})
    with pytest.raises(StaleStoreError, match=r"stale.*boundary: store has 2, expected 3; dataset: store has 'topics', expected 'wiki'"):
        open_store(path, expect_fingerprint=other)
    with pytest.raises(StaleStoreError, match=r"digest: store has 'digest-a', expected 'digest-z' \(readable parts are equal\)"):
        open_store(path, expect_fingerprint=Fingerprint("digest-z", FP.parts))
    assert open_store(path, expect_fingerprint={"digest": "digest-a", "parts": {}}).fingerprint == FP
    assert issubclass(StaleStoreError, StorageError) and issubclass(CorruptStoreError, StorageError)


def test_unknown_format_version_refused(tmp_path):
    path, _ = finished(tmp_path)
    manifest = pathlib.Path(path, "manifest.json")
    data = json.loads(manifest.read_text())
    data["format_version"] = 99
    manifest.write_text(json.dumps(data))
    with pytest.raises(UnsupportedFormatError, match="format version 99, but this tool reads only version 1"):
        open_store(path)
    assert not verify(path).ok


def test_a_backend_provides_exactly_the_abstract_hooks(tmp_path):
    assert Store.__abstractmethods__ == {"_write_data", "_read_data"}
    assert Blobs.__abstractmethods__ == {"read", "write", "size", "list", "remove", "remove_all"}
    assert all(not backend.__abstractmethods__ for backend in (ZarrStore, SafetensorsStore, MemoryStore))

    class WritesOnly(Store):
        def _write_data(self, i, tensors):
            return {}

    manifest = small_store(str(tmp_path / "s")).manifest
    with pytest.raises(TypeError, match="_read_data"):
        WritesOnly(MemoryBlobs("partial"), manifest)


def test_storage_is_model_free_and_pickle_free():
    root = pathlib.Path(storage.__file__).parent
    for source in root.glob("*.py"):
        text = source.read_text()
        for forbidden in (r"\b(import|from) (preinfer|pipelines)\b", r"pickle", r"(?<![\w.])torch\.load\("):
            assert not re.search(forbidden, text), (source.name, forbidden)


# ---- direct reads of zarr shard files (one sequential read, whole-file CRC32C, decoded by storage) ----------------
def _wide_store(path: str, codec, num_samples: int = 11) -> storage.Store:
    fields = {"bf16": ((3, 5), torch.bfloat16), "f32": ((2,), torch.float32), "b": ((3,), torch.bool)}
    return create_store(path, fields=fields, num_samples=num_samples, samples_per_shard=4, fingerprint=FP,
                        codec=codec)


@pytest.mark.parametrize("where", ["local", "url"])
@pytest.mark.parametrize("codec", [None, "zstd", "none", "blosc-lz4"])
@pytest.mark.parametrize("chunk", [None, 1, 2])  # None: the layout create_store picks; 1, 2: several chunks a shard
def test_zarr_direct_read_equals_zarr(tmp_path, monkeypatch, where, codec, chunk):
    import zarr

    import storage.zarr_backend as zb

    if chunk is not None:  # also how stores made with another chunking (e.g. older ones) are laid out
        monkeypatch.setattr(zb, "layout_chunk_samples", lambda codec, per_shard, sample_bytes: chunk)
    store = _wide_store(make_path(tmp_path, "zarr", where), codec)
    fill(store, [0, 2])
    zeros = {name: torch.zeros_like(t) for name, t in shard_data(store, 1).items()}
    store.write_shard(1, zeros)  # every chunk equals the fill value: still stored, still read back
    store.finalize()
    reopened = open_store(store.path)
    for i in range(3):
        assert all(reopened._layouts[name] is not None for name in reopened.fields)  # read by _read_direct
        got = reopened.read_shard(i)
        start, stop = reopened.shard_range(i)
        expected = zeros if i == 1 else shard_data(reopened, i)
        for name in reopened.fields:
            assert bits_equal(got[name], expected[name]), (codec, chunk, name, i)
            plain = zarr.open_array(reopened._blobs.zarr_store("data"), path=name, mode="r")[start:stop]
            assert bits_equal(storage.dtypes.from_numpy(plain, reopened.fields[name].dtype), got[name])
    assert verify(store.path).ok


def test_codec_none_has_one_chunk_per_shard_and_reads_without_a_copy(tmp_path):
    import zarr

    path, store = finished(tmp_path, "zarr", "none")
    array = zarr.open_array(str(tmp_path / "s" / "data"), path="hidden", mode="r")
    assert array.metadata.to_dict()["codecs"][0]["configuration"]["chunk_shape"][0] == store.samples_per_shard
    reopened, buffers = open_store(path), []
    read_buffer = reopened._blobs.read_buffer
    reopened._blobs.read_buffer = lambda key: buffers.append(read_buffer(key)) or buffers[-1]
    got = reopened.read_shard(0, ["hidden"])["hidden"]
    assert got.data_ptr() == buffers[0].ctypes.data  # a view of the file's bytes as read


def test_swapped_zarr_shard_files_are_caught(tmp_path):
    path, _ = finished(tmp_path, "zarr", "none")
    shard_file(path, "zarr", 1).write_bytes(shard_file(path, "zarr", 0).read_bytes())  # same size, valid chunk CRCs
    with pytest.raises(CorruptStoreError, match=r"shard 1 \(samples 4\.\.8\) is corrupt: checksum of the decoded"):
        open_store(path).read_shard(1)
    assert [p.shard for p in verify(path).bad] == [1]


@pytest.mark.parametrize("codec", [None, "none"])
@pytest.mark.parametrize("offset", [0, 40, -30, -2])  # first chunk, inside data, the index, the index's CRC32C
def test_flipped_byte_names_the_failing_crc(tmp_path, codec, offset):
    path, _ = finished(tmp_path, "zarr", codec)
    target = shard_file(path, "zarr", 1)
    raw = bytearray(target.read_bytes())
    raw[offset] ^= 0x01
    target.write_bytes(bytes(raw))
    with pytest.raises(CorruptStoreError, match=r"field 'hidden' of shard 1 \(samples 4\.\.8\) is corrupt: .*fails its CRC32C"):
        open_store(path).read_shard(1)


def test_all_zero_shard_is_written_on_zarr(tmp_path):
    store = small_store(str(tmp_path / "s"))
    fill(store, [0, 2])
    zeros = {name: torch.zeros_like(t) for name, t in shard_data(store, 1).items()}
    store.write_shard(1, zeros)  # zarr skips chunks equal to the fill value unless told otherwise
    store.finalize()
    assert all(torch.equal(t, zeros[k]) for k, t in open_store(store.path).read_shard(1).items())
