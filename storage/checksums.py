"""CRC32C checksums (hardware accelerated via google-crc32c) of tensors and byte strings."""

from __future__ import annotations

import google_crc32c
import numpy as np
import torch

from storage.dtypes import as_bytes


def crc32c_bytes(data: bytes | np.ndarray) -> str:
    """The CRC32C of a byte string or uint8 array, as 8 hex digits."""
    if not isinstance(data, np.ndarray):
        data = np.frombuffer(data, dtype=np.uint8)
    return f"{google_crc32c.value(data):08x}"


def crc32c_tensor(tensor: torch.Tensor) -> str:
    """The CRC32C of a contiguous CPU tensor's raw bytes (dtype-independent), as 8 hex digits."""
    return crc32c_bytes(as_bytes(tensor))
