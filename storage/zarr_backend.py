"""The zarr v3 backend: one array per field, chunked along samples, one zarr shard per store shard."""

from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass

import google_crc32c
import numcodecs.blosc
import numcodecs.zstd
import numpy as np
import torch
import zarr
from zarr.codecs import BloscCodec, BytesCodec, Crc32cCodec, ShardingCodec, ShardingCodecIndexLocation, ZstdCodec
from zarr.errors import UnknownCodecError

from storage.codecs import zarr_compressors
from storage.dtypes import from_numpy, numpy_dtype, to_numpy, torch_dtype
from storage.errors import CorruptStoreError, UnsupportedFormatError
from storage.manifest import FORMAT
from storage.store import Store

# Target uncompressed bytes of one chunk (the unit of compression, checksumming and parallel decoding).
CHUNK_BYTES = 4 << 20


def chunk_samples(samples_per_shard: int, sample_bytes: int, target: int = CHUNK_BYTES) -> int:
    """The largest divisor of `samples_per_shard` whose chunk stays within `target` bytes (at least 1)."""
    fitting = [c for c in range(1, samples_per_shard + 1) if samples_per_shard % c == 0 and c * sample_bytes <= target]
    return max(fitting, default=1)


def layout_chunk_samples(codec: str, samples_per_shard: int, sample_bytes: int) -> int:
    """Samples per chunk of a new array: codec none keeps one chunk per shard (its data is then one contiguous run
    of the shard file, read without a copy); compressed codecs use ~CHUNK_BYTES chunks."""
    return samples_per_shard if codec == "none" else chunk_samples(samples_per_shard, sample_bytes)


def dimension_names(field: str, per_sample_dims: int) -> tuple[str, ...]:
    """The dimension names of a field's array: "sample", then "token", then "<field>_dim" (so that xarray sees
    the arrays of a split as one dataset: hidden is (sample, token, hidden_dim), the token-wise fields and a
    lossy field's scale are (sample, token))."""
    extra = [f"{field}_dim"] if per_sample_dims == 2 else [f"{field}_dim{j}" for j in range(1, per_sample_dims)]
    return ("sample", *(["token"] if per_sample_dims else []), *extra)


# An index entry of a chunk the shard does not hold (zarr writes no chunk that equals the fill value).
_NO_CHUNK = 2**64 - 1


@dataclass(frozen=True)
class ShardLayout:
    """What reading a zarr shard file directly needs: chunk grid, inner compressor, item layout."""

    chunk_samples: int
    chunks_per_shard: int
    chunk_bytes: int
    compressor: str  # "none", "blosc" or "zstd"


def shard_layout(array: zarr.Array) -> ShardLayout | None:
    """The layout of `array`'s shards if it is one this module decodes itself (the one create_store writes:
    sharding with an index at the end, chunks split along samples only, bytes -> [blosc | zstd] -> crc32c,
    fill value 0, little-endian host), else None (such arrays are read through zarr)."""
    meta = array.metadata
    codecs = getattr(meta, "codecs", ())
    if sys.byteorder != "little" or len(codecs) != 1 or not isinstance(codecs[0], ShardingCodec):
        return None
    sharding = codecs[0]
    inner, index = list(sharding.codecs), list(sharding.index_codecs)
    little = ("little", None)
    if (
        sharding.index_location != ShardingCodecIndexLocation.end
        or len(index) != 2 or not isinstance(index[0], BytesCodec) or not isinstance(index[1], Crc32cCodec)
        or not 2 <= len(inner) <= 3 or not isinstance(inner[0], BytesCodec) or not isinstance(inner[-1], Crc32cCodec)
        or getattr(inner[0].endian, "value", inner[0].endian) not in little
        or not np.all(np.asarray(array.fill_value) == 0)
    ):
        return None
    compressor = "none"
    if len(inner) == 3:
        if not isinstance(inner[1], (BloscCodec, ZstdCodec)):
            return None
        compressor = "blosc" if isinstance(inner[1], BloscCodec) else "zstd"
    shard_shape, chunk_shape = tuple(meta.chunk_grid.chunk_shape), tuple(sharding.chunk_shape)
    if chunk_shape[1:] != shard_shape[1:] or shard_shape[0] % chunk_shape[0]:
        return None
    return ShardLayout(
        chunk_samples=chunk_shape[0], chunks_per_shard=shard_shape[0] // chunk_shape[0],
        chunk_bytes=math.prod(chunk_shape) * array.dtype.itemsize, compressor=compressor,
    )


class ZarrStore(Store):
    """Fields as zarr v3 arrays under `data/`, sharded by store shard, every chunk CRC32C-checked."""

    format = "zarr"
    data_prefix = "data"

    def _create_layout(self) -> None:
        zstore = self._blobs.zarr_store(self.data_prefix)
        zarr.create_group(zstore, overwrite=True, attributes={"format": FORMAT, "fields": list(self.fields)})
        per_shard = self.samples_per_shard
        encodings = self._manifest.get("encodings", {})
        for name, spec in self.fields.items():
            dtype = numpy_dtype(spec.dtype)
            chunk = layout_chunk_samples(self.codec["name"], per_shard, spec.sample_bytes)
            zarr.create_array(
                zstore, name=name, shape=(self.num_samples, *spec.shape), dtype=dtype,
                chunks=(chunk, *spec.shape), shards=(per_shard, *spec.shape),
                compressors=zarr_compressors(self.codec, dtype.itemsize), fill_value=dtype.type(0),
                attributes={"dtype": spec.dtype, **({"encoding": encodings[name]} if name in encodings else {})},
                dimension_names=dimension_names(name, len(spec.shape)), overwrite=True,
            )

    def _open_layout(self) -> None:
        zstore = self._blobs.zarr_store(self.data_prefix)
        self._arrays = {}
        for name, spec in self.fields.items():
            self._check_zarr_format(name)
            try:
                array = zarr.open_array(zstore, path=name, mode="r+", zarr_format=3)
            except UnknownCodecError as err:
                raise UnsupportedFormatError(
                    f"store {self.path}: the zarr array of field {name!r} ({self.data_prefix}/{name}/zarr.json) "
                    f"names a codec this zarr {zarr.__version__} does not have ({err}; written by another zarr or "
                    f"numcodecs version); rebuild the store with preinfer cache --overwrite, or read it where that "
                    f"codec is installed"
                ) from None
            except Exception as err:
                raise CorruptStoreError(
                    f"store {self.path}: the zarr array of field {name!r} ({self.data_prefix}/{name}/zarr.json) is "
                    f"missing or unreadable ({type(err).__name__}: {err}); rebuild the store"
                ) from None
            expected = ((self.num_samples, *spec.shape), numpy_dtype(spec.dtype))
            if (array.shape, array.dtype) != expected:
                raise CorruptStoreError(
                    f"store {self.path}: zarr array {name!r} has shape {array.shape} and dtype {array.dtype}, the "
                    f"manifest says {expected[0]} and {expected[1]}; rebuild the store"
                )
            # Every chunk is stored, also one that equals the fill value: zarr would otherwise write no file at all
            # for a shard of zeros (an all-False mask), and a shard must have its files to be complete.
            self._arrays[name] = array.with_config({"write_empty_chunks": True})
        self._layouts = {name: shard_layout(array) for name, array in self._arrays.items()}

    def _check_zarr_format(self, name: str) -> None:
        """Refuse the array of field `name` when another zarr format wrote it (zarr 2's `.zarray`, a `zarr.json` of
        another `zarr_format`): zarr would read a zarr 2 array as neither sharded nor with this store's codecs."""
        key = f"{self.data_prefix}/{name}"
        if self._blobs.size(f"{key}/zarr.json") is None:
            found = 2 if self._blobs.size(f"{key}/.zarray") is not None else None
        else:
            try:
                found = json.loads(self._blobs.read(f"{key}/zarr.json")).get("zarr_format")
            except (ValueError, AttributeError):
                return  # not JSON (or not an object): opening it says so
        if found not in (None, 3):
            raise UnsupportedFormatError(
                f"store {self.path}: the array of field {name!r} ({key}) is in zarr format {found} (written by "
                f"another zarr version or tool), this store's format is zarr 3; rebuild the store with preinfer "
                f"cache --overwrite"
            )

    def _shard_key(self, name: str, i: int) -> str:
        coords = (i,) + (0,) * len(self.fields[name].shape)
        return f"{self.data_prefix}/{name}/{self._arrays[name].metadata.encode_chunk_key(coords)}"

    def _write_data(self, i: int, tensors: dict[str, torch.Tensor]) -> dict[str, dict]:
        start, stop = self.shard_range(i)
        files = {}
        for name, tensor in tensors.items():
            self._arrays[name][start:stop] = to_numpy(tensor)
            key = self._shard_key(name, i)
            self._blobs.sync(key)
            files[key] = {"size": self._blobs.size(key)}
        return files

    def _read_data(self, i: int, names: list[str]) -> dict[str, torch.Tensor]:
        start, stop = self.shard_range(i)
        return {
            name: self._read_direct(i, name) if self._layouts[name] is not None
            else from_numpy(self._arrays[name][start:stop], self.fields[name].dtype)
            for name in names
        }

    def _read_direct(self, i: int, name: str) -> torch.Tensor:
        """Field `name` of shard `i` from one sequential read of its zarr shard file, decoded here (zarr's format:
        chunks, each followed by its CRC32C, then the index of (offset, nbytes) and the index's CRC32C).

        Every byte used is checked as zarr would: the index and each chunk against their CRC32C. (A CRC32C over the
        whole file would not do: a CRC over data followed by its own CRC is a constant, so such a file CRC only
        depends on the index.) Codec none with one chunk per shard returns a view of the read buffer."""
        start, stop = self.shard_range(i)
        spec, layout, key = self.fields[name], self._layouts[name], self._shard_key(name, i)
        buf = self._blobs.read_buffer(key)
        info = self._record(i)["files"][key]
        if len(buf) != info["size"]:
            raise self._corrupt(i, f"file {key} has {len(buf)} bytes, expected {info['size']} (truncated)", name)

        def crc_ok(data: np.ndarray, trailer: np.ndarray) -> bool:
            return google_crc32c.value(data) == int.from_bytes(trailer.tobytes(), "little")

        n, size = layout.chunks_per_shard, layout.chunk_bytes
        if len(buf) < 16 * n + 4 or not crc_ok(buf[len(buf) - 4 - 16 * n : -4], buf[-4:]):
            raise self._corrupt(i, f"the shard index of file {key} fails its CRC32C", name)
        n, size = layout.chunks_per_shard, layout.chunk_bytes
        index = buf[len(buf) - 4 - 16 * n : len(buf) - 4].view("<u8").reshape(n, 2)
        dtype, shape = torch_dtype(spec.dtype), (layout.chunk_samples * n, *spec.shape)
        count = stop - start
        if layout.compressor == "none" and n == 1 and index[0, 0] != _NO_CHUNK:
            offset, nbytes = int(index[0, 0]), int(index[0, 1])
            if nbytes != size + 4 or offset + nbytes > len(buf):
                raise self._corrupt(i, f"chunk of {nbytes} bytes in {key}, expected {size + 4}", name)
            if not crc_ok(buf[offset : offset + size], buf[offset + size : offset + nbytes]):
                raise self._corrupt(i, f"chunk 0 of file {key} fails its CRC32C", name)
            return torch.from_numpy(buf[offset : offset + size]).view(dtype).view(shape)[:count]
        out = torch.empty(shape, dtype=dtype)
        dest = out.view(-1).view(torch.uint8).numpy()
        for j in range(min(n, -(-count // layout.chunk_samples))):  # chunks past the array's end are never written
            target = dest[j * size : (j + 1) * size]
            offset, nbytes = int(index[j, 0]), int(index[j, 1])
            if offset == _NO_CHUNK:
                target.fill(0)  # a chunk equal to the fill value (0) is not stored
                continue
            if offset + nbytes > len(buf) or nbytes < 4:
                raise self._corrupt(i, f"chunk {j} of {key} lies outside the file", name)
            raw = buf[offset : offset + nbytes - 4]
            if not crc_ok(raw, buf[offset + nbytes - 4 : offset + nbytes]):
                raise self._corrupt(i, f"chunk {j} of file {key} fails its CRC32C", name)
            if layout.compressor == "none":
                if len(raw) != size:
                    raise self._corrupt(i, f"chunk {j} of {key} has {len(raw)} bytes, expected {size}", name)
                target[:] = raw
            elif layout.compressor == "blosc":
                if len(raw) < 16 or int.from_bytes(raw[4:8].tobytes(), "little") != size:
                    raise self._corrupt(i, f"chunk {j} of {key} does not decode to {size} bytes", name)
                numcodecs.blosc.decompress(raw, target)
            else:
                numcodecs.zstd.decompress(raw, target)
        return out[:count]
