"""The safetensors backend: one `.safetensors` file per shard (native bf16) and an index JSON."""

from __future__ import annotations

import json

import safetensors.torch
import torch

from storage.checksums import crc32c_bytes
from storage.manifest import FORMAT
from storage.store import Store

INDEX = "shards.safetensors.index.json"


class SafetensorsStore(Store):
    """Shards as `shards/shard-NNNNNN.safetensors`, each file's CRC32C recorded when it is published."""

    format = "safetensors"
    data_prefix = "shards"
    check_decoded = False  # the CRC32C of the whole file is checked on every read

    def _shard_key(self, i: int) -> str:
        return f"{self.data_prefix}/shard-{i:06d}.safetensors"

    def _write_data(self, i: int, tensors: dict[str, torch.Tensor]) -> dict[str, dict]:
        start, stop = self.shard_range(i)
        data = safetensors.torch.save(tensors, metadata={"shard": str(i), "samples": f"{start}..{stop}"})
        key = self._shard_key(i)
        self._blobs.write(key, data)
        return {key: {"size": len(data), "crc32c": crc32c_bytes(data)}}

    def _read_data(self, i: int, names: list[str]) -> dict[str, torch.Tensor]:
        key = self._shard_key(i)
        data = self._blobs.read(key)
        expected = self._record(i)["files"][key]["crc32c"]
        if crc32c_bytes(data) != expected:
            raise self._corrupt(i, f"file {key} fails its CRC32C (stored bytes changed since it was written)")
        tensors = safetensors.torch.load(data)
        return {name: tensors[name] for name in names}

    def _finalize_layout(self) -> None:
        shards = {
            self._shard_key(i).rsplit("/", 1)[-1]: {
                "samples": self._records[i]["samples"], **self._records[i]["files"][self._shard_key(i)]
            }
            for i in range(self.num_shards)
        }
        index = {
            "metadata": {
                "format": FORMAT, "num_samples": self.num_samples,
                "total_size": sum(s["size"] for s in shards.values()), "fields": self._manifest["fields"],
            },
            "shards": shards,
        }
        self._blobs.write(INDEX, json.dumps(index, indent=1).encode())
