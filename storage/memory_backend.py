"""The memory backend: shards kept as tensors in this process, for small caches."""

from __future__ import annotations

import torch

from storage.store import Store


class MemoryStore(Store):
    """Shards held as tensor dicts in the store's MemoryBlobs (no files, no compression)."""

    format = "memory"
    check_decoded = False  # tensors never leave this process's memory

    def _write_data(self, i: int, tensors: dict[str, torch.Tensor]) -> dict[str, dict]:
        self._blobs.tensors[i] = {name: tensor.clone() for name, tensor in tensors.items()}
        return {}

    def _read_data(self, i: int, names: list[str]) -> dict[str, torch.Tensor]:
        return {name: self._blobs.tensors[i][name].clone() for name in names}
