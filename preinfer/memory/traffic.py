"""A store's bytes per token on disk, and the activation traffic of pipeline-parallel BCD against one caching pass
and its reads."""

from __future__ import annotations

import re

from preinfer.config.choices import STORE_DTYPES as STORE_DTYPE_NAMES
from preinfer.memory.settings import DTYPES, Settings
from preinfer.memory.shapes import ModelShape


# Store dtypes of boundary states (`preinfer.config.choices.STORE_DTYPES`): bytes per stored element, from the bits
# each name gives. The lossy 8-bit encodings (float8_e4m3, float8_e5m2, int8) add a float32 scale per token
# (storage.bytes_per_token is the same count; a test holds them equal).
STORE_DTYPES = {name: int(re.search(r"\d+", name).group()) // 8 for name in STORE_DTYPE_NAMES}
LOSSY_SCALE_BYTES = 4

# Store compression: Blosc zstd level 1 + byte shuffle compresses bf16 activations 1.46x (measured on GPT-2
# activations, see DESIGN.md). The 8-bit codes of the lossy dtypes keep less redundancy: on a trained small-llama
# (docs/results.md, the lower of boundaries 2 and 4) float8_e4m3 1.10x, float8_e5m2 1.30x, int8 none. float32 and
# float16 are assumed uncompressed.
COMPRESSION = {"bfloat16": 1.46, "float32": 1.0, "float16": 1.0, "float8_e4m3": 1.1, "float8_e5m2": 1.3, "int8": 1.0}



def store_dtype(settings: Settings) -> str:
    """Storage dtype of boundary states: the chosen one, else float32 when training in float32, else bfloat16."""
    if settings.store_dtype is not None:
        return settings.store_dtype
    return "float32" if settings.dtype == "float32" else "bfloat16"


def store_bytes_per_token(m: ModelShape, settings: Settings) -> float:
    """On-disk bytes of one token's hidden state at a boundary, a lossy encoding's scale included (side tensors
    such as labels not counted)."""
    kind = store_dtype(settings)
    ratio = settings.compression if settings.compression is not None else COMPRESSION[kind]
    scale = LOSSY_SCALE_BYTES if STORE_DTYPES[kind] == 1 else 0
    return (m.hidden * STORE_DTYPES[kind] + scale) / ratio


def traffic(m: ModelShape, settings: Settings, degree: int) -> dict:
    """Activation traffic of pipeline-parallel BCD against one caching pass and its reads, per token.

    Pipeline: at each of the degree - 1 stage boundaries, forward activations and backward gradients of b*s*h
    elements cross the link every step (worst case: the active block on the first stage). Pre-inference: one
    caching pass writes the boundary store once and every epoch reads it back over the same link (compressed).
    Break-even epochs E solve E * pipeline = write + E * read.
    """
    c = DTYPES[settings.dtype]["act"]
    pipeline = 2 * (degree - 1) * m.hidden * c
    store = store_bytes_per_token(m, settings)
    break_even = store / (pipeline - store) if pipeline > store else None  # None: never breaks even
    result = dict(
        pipeline_degree=degree, pipeline_bytes_per_token=pipeline,
        pipeline_bytes_per_step=pipeline * settings.seq_len * settings.micro_batch,
        cache_write_bytes_per_token=store, cache_read_bytes_per_token_per_epoch=store,
        break_even_epochs=break_even,
        pays_off=break_even is not None and break_even <= settings.epochs_per_visit,
    )
    if settings.tokens:
        link = settings.bandwidth_gbps * 1e9 / 8  # bytes per second on one link
        result["pipeline_seconds_per_epoch"] = settings.tokens * pipeline / link
        result["cache_seconds_per_epoch"] = settings.tokens * store / link
    return result
