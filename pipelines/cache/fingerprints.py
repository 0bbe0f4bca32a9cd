"""What a store of boundary states is: its fingerprint, its fields and its shard size (a run's too)."""

from __future__ import annotations

from typing import Any

import torch

from pipelines.data.batches import TokenSamples
from preinfer.config import Config
from preinfer.errors import UsageError
from preinfer.fingerprint import boundary_fingerprint, prefix_digest
from preinfer.staged import StagedModel
from storage import Fingerprint
from storage import bytes_per_token as storage_bytes_per_token
from pipelines.cache.options import resolve_store_dtype, store_dtype_name

SHARD_TARGET_BYTES = 64 << 20


def dtype_name(dtype: torch.dtype) -> str:
    """A torch dtype's name without the "torch." prefix."""
    return str(dtype).removeprefix("torch.")


def check_boundary(staged: StagedModel, boundary: int, above: int = 0) -> None:
    """Refuse a boundary outside [max(1, above + 1), layers] with a one-line UsageError."""
    low = max(1, above + 1)
    if not isinstance(boundary, int) or not low <= boundary <= staged.num_layers:
        why = f" (above the source store's boundary {above})" if above else ""
        raise UsageError(
            f"--boundary {boundary} is outside [{low}, {staged.num_layers}]{why}: the model has "
            f"{staged.num_layers} layers and boundary k stores the input of layer k"
        )


def state_fingerprint(prefix: str, boundary: int, dataset: str, tokenizer: str, seq_len: int, dtype: str,
                      attention: str, model_name: str) -> Fingerprint:
    """The fingerprint of boundary states from its parts (`prefix`: the prefix digest at `boundary`; `attention`:
    the implementation the prefix ran)."""
    digest, parts = boundary_fingerprint(prefix, boundary, dataset, tokenizer, seq_len, dtype, attention,
                                         model=model_name)
    return Fingerprint(digest, parts)


def cache_fingerprint(staged: StagedModel, dataset: TokenSamples, tokenizer: Any, boundary: int,
                      dtype: str | torch.dtype = "auto", model_name: str = "", prefix: str | None = None) -> Fingerprint:
    """The fingerprint of `dataset`'s boundary states at `boundary` stored in `dtype` ("auto": the compute dtype).
    `prefix`: the prefix digest, when `staged` does not hold the whole prefix (as `cache_boundary` takes it)."""
    stored = store_dtype_name(resolve_store_dtype(dtype, staged.compute_dtype))
    digest = prefix if prefix is not None else prefix_digest(staged, boundary)
    return state_fingerprint(digest, boundary, dataset.fingerprint(),
                             tokenizer.fingerprint(), dataset.seq_len, stored, staged.attention, model_name)


def bytes_per_token(store_dtype: str, hidden_size: int, compute_dtype: torch.dtype) -> int:
    """Uncompressed bytes of one token's stored hidden state in `store_dtype` ("auto": the compute dtype), a lossy
    encoding's scale included."""
    return storage_bytes_per_token(store_dtype_name(resolve_store_dtype(store_dtype, compute_dtype)), hidden_size)


def default_samples_per_shard(seq_len: int, hidden_size: int, dtype: torch.dtype,
                              target: int = SHARD_TARGET_BYTES) -> int:
    """Samples per shard so that a shard holds about `target` bytes of hidden states (at least 1)."""
    sample_bytes = seq_len * hidden_size * torch.empty((), dtype=dtype).element_size()
    return max(1, target // sample_bytes)


def samples_per_shard(config: Config, staged: StagedModel) -> int:
    """A run's shard size: the configured one, or the caching job's default for boundary states in the compute
    dtype (the same as `preinfer cache` picks, so live and stored runs read in the same order)."""
    if config.data.samples_per_shard:
        return config.data.samples_per_shard
    return default_samples_per_shard(config.data.seq_len, staged.hidden_size, staged.compute_dtype)


def store_fields(seq_len: int, hidden_size: int, dtype: torch.dtype) -> dict[str, tuple[tuple[int, ...], Any]]:
    """The fields of a store of boundary states (`BoundaryState.to_dict()` of one sample)."""
    return {
        "hidden": ((seq_len, hidden_size), dtype),
        "attention_mask": ((seq_len,), torch.bool),
        "position_ids": ((seq_len,), torch.int64),
        "labels": ((seq_len,), torch.int64),
    }
