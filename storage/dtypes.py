"""The tensor dtypes a store holds, their manifest names, and how each maps to a numpy storage dtype."""

from __future__ import annotations

import numpy as np
import torch

from storage.errors import StorageError

# manifest name -> (torch dtype, numpy dtype of the stored bits). bfloat16 travels as its uint16 bit pattern, the
# float8 codes of the lossy encodings (storage.encodings) as their uint8 bit patterns.
DTYPES: dict[str, tuple[torch.dtype, np.dtype]] = {
    "float32": (torch.float32, np.dtype("float32")),
    "float16": (torch.float16, np.dtype("float16")),
    "bfloat16": (torch.bfloat16, np.dtype("uint16")),
    "float8_e4m3": (torch.float8_e4m3fn, np.dtype("uint8")),
    "float8_e5m2": (torch.float8_e5m2, np.dtype("uint8")),
    "int8": (torch.int8, np.dtype("int8")),
    "uint8": (torch.uint8, np.dtype("uint8")),
    "uint16": (torch.uint16, np.dtype("uint16")),
    "int32": (torch.int32, np.dtype("int32")),
    "int64": (torch.int64, np.dtype("int64")),
    "bool": (torch.bool, np.dtype("bool")),
}
# torch dtypes numpy lacks, viewed as the unsigned integers of their width
_BIT_PATTERNS = {torch.bfloat16: torch.uint16, torch.float8_e4m3fn: torch.uint8, torch.float8_e5m2: torch.uint8}
_NAMES = {torch_dtype: name for name, (torch_dtype, _) in DTYPES.items()}


def dtype_name(dtype: torch.dtype | str) -> str:
    """The manifest name of a supported dtype (a torch dtype or its name)."""
    if isinstance(dtype, str) and dtype in DTYPES:
        return dtype
    if isinstance(dtype, torch.dtype) and dtype in _NAMES:
        return _NAMES[dtype]
    raise StorageError(f"unsupported dtype {dtype!r}; a store holds one of {', '.join(DTYPES)}")


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a manifest dtype name."""
    return DTYPES[dtype_name(name)][0]


def numpy_dtype(name: str) -> np.dtype:
    """The numpy dtype the bits of a manifest dtype are stored as."""
    return DTYPES[dtype_name(name)][1]


def to_numpy(tensor: torch.Tensor) -> np.ndarray:
    """A zero-copy numpy view of a contiguous CPU tensor's bits (bfloat16 as uint16, float8 as uint8)."""
    if tensor.dtype in _BIT_PATTERNS:
        tensor = tensor.view(_BIT_PATTERNS[tensor.dtype])
    return tensor.numpy()


def from_numpy(array: np.ndarray, name: str) -> torch.Tensor:
    """A tensor of dtype `name` over the bits of `array`, without a copy where numpy allows it."""
    if not array.flags.writeable:
        array = array.copy()
    tensor = torch.from_numpy(array)
    wanted = DTYPES[name][0]
    return tensor.view(wanted) if wanted in _BIT_PATTERNS else tensor


def as_bytes(tensor: torch.Tensor) -> np.ndarray:
    """The raw bytes of a contiguous CPU tensor as a flat uint8 numpy view."""
    return to_numpy(tensor).reshape(-1).view(np.uint8)
