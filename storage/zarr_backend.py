"""The zarr v3 backend: one array per field, chunked along samples, one zarr shard per store shard."""

from __future__ import annotations

import torch
import zarr

from storage.codecs import zarr_compressors
from storage.dtypes import from_numpy, numpy_dtype, to_numpy
from storage.errors import CorruptStoreError
from storage.store import Store

# Target uncompressed bytes of one chunk (the unit of compression, checksumming and parallel decoding).
CHUNK_BYTES = 4 << 20


def chunk_samples(samples_per_shard: int, sample_bytes: int, target: int = CHUNK_BYTES) -> int:
    """The largest divisor of `samples_per_shard` whose chunk stays within `target` bytes (at least 1)."""
    fitting = [c for c in range(1, samples_per_shard + 1) if samples_per_shard % c == 0 and c * sample_bytes <= target]
    return max(fitting, default=1)


class ZarrStore(Store):
    """Fields as zarr v3 arrays under `data/`, sharded by store shard, every chunk CRC32C-checked."""

    backend = "zarr"
    data_prefix = "data"

    def _create_layout(self) -> None:
        zstore = self._blobs.zarr_store(self.data_prefix)
        per_shard = self.samples_per_shard
        for name, spec in self.fields.items():
            dtype = numpy_dtype(spec.dtype)
            chunk = chunk_samples(per_shard, spec.sample_bytes)
            zarr.create_array(
                zstore, name=name, shape=(self.num_samples, *spec.shape), dtype=dtype,
                chunks=(chunk, *spec.shape), shards=(per_shard, *spec.shape),
                compressors=zarr_compressors(self.codec, dtype.itemsize), fill_value=dtype.type(0),
                attributes={"dtype": spec.dtype}, overwrite=True,
            )

    def _open_layout(self) -> None:
        zstore = self._blobs.zarr_store(self.data_prefix)
        self._arrays = {}
        for name, spec in self.fields.items():
            try:
                array = zarr.open_array(zstore, path=name, mode="r+")
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
            self._arrays[name] = array

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
        return {name: from_numpy(self._arrays[name][start:stop], self.fields[name].dtype) for name in names}
