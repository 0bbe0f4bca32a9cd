"""Fingerprints: content hashes of everything a boundary state depends on.

The prefix digest covers the adapter that computes the states (its identity: family and version, so that a
state computed by another adapter or an older version of it is not taken for this one's) and exactly the
parameters and buffers that the embedding and layers `[0, k)` use (a tied weight and shared modules such as the
rotary embedding included), tensor by tensor, so hashing a large prefix never needs a second copy of it in
memory. A weight held in fewer bits (`--frozen-dtype`) counts as its master (name, dtype, bytes) and how it is
held (the frozen dtype, from `__tensor_flatten__`), never as its codes, which are a function of the two:
pre-inference runs the prefix as the model holds it, so a store made under a frozen dtype is that prefix's, and
the same masters held exactly, or in another frozen dtype, have another digest.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from preinfer.staged import StagedModel

FINGERPRINT_VERSION = 1


def named_prefix_tensors(staged: StagedModel, boundary: int) -> Iterator[tuple[str, torch.Tensor]]:
    """(qualified name, tensor) of every parameter and buffer the state at `boundary` depends on, each once,
    in a fixed order; first of all the adapter's identity, as an `adapter:` entry holding its UTF-8 bytes."""
    identity = staged.identity.encode()
    yield f"adapter:{staged.identity}", torch.tensor(list(identity), dtype=torch.uint8)
    names: dict[int, str] = {}
    for name, t in _named_tensors(staged.model):
        names.setdefault(id(t), name)  # a tied tensor goes by its first name
    seen: set[int] = set()
    for module in staged.prefix_modules(boundary):
        for tensor in _module_tensors(module):
            if id(tensor) not in seen:
                seen.add(id(tensor))
                yield names.get(id(tensor), "?"), tensor


def hash_tensors(tensors: Iterable[tuple[str, torch.Tensor]]) -> str:
    """sha256 over each tensor's name, dtype, shape and raw bytes, streamed one tensor at a time."""
    h = hashlib.sha256()
    for name, tensor in tensors:
        h.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}{_held_as(tensor)}\n".encode())
        h.update(_raw_bytes(tensor))
    return h.hexdigest()


def prefix_digest(staged: StagedModel, boundary: int) -> str:
    return hash_tensors(named_prefix_tensors(staged, boundary))


def boundary_fingerprint(
    prefix: str,
    boundary: int,
    dataset: str,
    tokenizer: str,
    seq_len: int,
    dtype: str,
    attention: str,
    model: str = "",
) -> tuple[str, dict[str, str | int]]:
    """(digest, readable parts) of a boundary state; `prefix`, `dataset` and `tokenizer` are content hashes,
    `model` a readable name only (it does not enter the digest: equal weights under another name are equal).

    `attention` (sdpa, eager) enters the digest: the two implementations' states differ in their last bits
    (small-llama, boundary 6: 3.9e-7 apart in float32, 1.2e-2 in bf16), so an exact store of one is not the
    other's, bit for bit."""
    parts: dict[str, str | int] = {
        "prefix": prefix, "boundary": boundary, "dataset": dataset, "tokenizer": tokenizer,
        "seq_len": seq_len, "dtype": dtype, "attention": attention, "version": FINGERPRINT_VERSION,
    }
    digest = hashlib.sha256(repr(sorted(parts.items())).encode()).hexdigest()
    return digest, {"model": model, **parts}


def _named_tensors(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    yield from model.named_parameters(remove_duplicate=False)
    yield from model.named_buffers(remove_duplicate=False)


def _module_tensors(module: nn.Module) -> Iterator[torch.Tensor]:
    yield from module.parameters()
    yield from module.buffers()


def _held_as(tensor: torch.Tensor) -> str:
    """How a tensor subclass holds its values (its type and `__tensor_flatten__` context: a frozen weight's dtype);
    nothing for a plain tensor, whose line is what it always was."""
    if not hasattr(tensor, "__tensor_flatten__"):
        return ""
    return f"|{type(tensor).__name__}:{tensor.__tensor_flatten__()[1]}"


def _raw_bytes(tensor: torch.Tensor) -> memoryview:
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy()) if flat.numel() else memoryview(b"")
