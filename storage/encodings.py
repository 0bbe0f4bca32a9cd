"""Lossy encodings of a float field: 8-bit codes with one float32 scale per row (per token), the codec math.

A row x (the last dimension of a field, e.g. one token's hidden state) is stored as codes q = x / s rounded to
the 8-bit format, with s = max|x| / M (M: the format's largest code), rounded up to a float32 that is at least the
smallest positive float32 (so an all-zero row has the smallest scale and zero codes, and a row whose scale would
be subnormal keeps a positive one). Decoding is q * s. Every element then decodes within `bound` * s of x, where
`bound` is half the format's largest code spacing (plus float32 rounding, max_code * 2^-23): 16 for float8_e4m3
(codes up to 448), 4096 for float8_e5m2 (codes up to 57344), 0.5 for int8 (round to nearest integer, codes up to
127). Within a binade the floating formats do better (a relative error of 2^-4 for e4m3, 2^-3 for e5m2).

Non-finite values cannot be encoded: `nonfinite_rows` finds them so that writers can refuse them by sample.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch

# float32's smallest positive (subnormal) value: the smallest scale.
_TINY = torch.finfo(torch.float32).smallest_normal * torch.finfo(torch.float32).eps
SCALE_SUFFIX = "_scale"


@dataclass(frozen=True)
class Encoding:
    """One lossy format: its code dtype, its largest code, and its error bound in units of the row's scale."""

    name: str
    code_dtype: torch.dtype
    max_code: float
    half_spacing: float  # half the largest gap between codes: the rounding error of a code
    # decode through a table of the 256 code values: torch converts float8_e4m3fn to float32 about 5x slower on a
    # CPU than the table (1 ms per 262,144 codes), while its int8 and float8_e5m2 conversions beat the table
    lookup: bool = False

    @property
    def bound(self) -> float:
        """The largest decoding error in units of the row's scale: the code's rounding plus float32's rounding of
        x / s and of q * s (each at most max_code * 2^-24)."""
        return self.half_spacing + self.max_code * 2.0**-23

    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(codes, scales) of finite float `x` [..., H]: codes [..., H] in the code dtype, scales [...] float32."""
        wide = x.float()
        absmax = wide.abs().amax(dim=-1)
        scale = (absmax.double() / self.max_code).float().clamp_min(_TINY)
        # rounded to nearest, a scale may fall short of max|x| / M: one step up makes every code fit
        short = absmax.double() / scale.double() > self.max_code
        scale = torch.where(short, torch.nextafter(scale, torch.full_like(scale, float("inf"))), scale)
        ratio = (wide / scale.unsqueeze(-1)).clamp_(-self.max_code, self.max_code)
        if not self.code_dtype.is_floating_point:
            ratio = ratio.round_()
        return ratio.to(self.code_dtype), scale

    @functools.cached_property
    def _values(self) -> np.ndarray:
        """The float32 value of each of the 256 codes, indexed by the code's bit pattern."""
        return torch.arange(256, dtype=torch.uint8).view(self.code_dtype).float().numpy()

    def decode(self, codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The values of CPU `codes` [..., H] with `scale` [...], in `dtype` (computed in float32: code x scale).

        With `lookup`, each code's value comes from a 256-entry table; the multiply is done in place by numpy on
        the calling thread (the reader decodes in its prefetch thread, where torch's intra-op pool would compete
        with the trainer for the cores)."""
        if self.lookup:
            values = np.take(self._values, codes.contiguous().view(torch.uint8).numpy())
        else:
            values = codes.float().numpy()
        with np.errstate(over="ignore"):  # inf like torch's multiply: writers refuse it (Store._encoded)
            np.multiply(values, scale.float().numpy()[..., None], out=values)
        decoded = torch.from_numpy(values)
        return decoded if dtype == torch.float32 else decoded.to(dtype)


ENCODINGS = {
    "float8_e4m3": Encoding("float8_e4m3", torch.float8_e4m3fn, 448.0, 16.0, lookup=True),
    "float8_e5m2": Encoding("float8_e5m2", torch.float8_e5m2, 57344.0, 4096.0),
    "int8": Encoding("int8", torch.int8, 127.0, 0.5),
}


def is_lossy(dtype: str) -> bool:
    """Whether a store dtype name is a lossy encoding (else an exact dtype)."""
    return dtype in ENCODINGS


def nonfinite_rows(x: torch.Tensor) -> list[int]:
    """Indices along the first dimension (samples) of `x` holding NaN or inf."""
    if not x.is_floating_point():
        return []
    return torch.nonzero(~torch.isfinite(x).reshape(len(x), -1).all(dim=1)).flatten().tolist()


def error_stats(x: torch.Tensor, decoded: torch.Tensor, scale: torch.Tensor, bound: float) -> dict[str, float]:
    """Sums and maxima of the decoding error of one shard, as recorded in its completion record: `sq_err` and
    `sq_ref` (sums of squares of the error and of x), `rms_rel` = sqrt(sq_err / sq_ref), `max_abs` (largest
    error) and `max_over_bound` (largest error / (bound * the row's scale); at most 1)."""
    error = (decoded.float() - x.float()).abs()
    row_max = error.amax(dim=-1)
    sq_err, sq_ref = float(error.double().square().sum()), float(x.double().square().sum())
    return {
        "sq_err": sq_err, "sq_ref": sq_ref, "rms_rel": (sq_err / sq_ref) ** 0.5 if sq_ref else 0.0,
        "max_abs": float(row_max.max()) if row_max.numel() else 0.0,
        "max_over_bound": float((row_max.double() / (bound * scale.double())).max()) if row_max.numel() else 0.0,
    }


def merge_stats(stats: list[dict[str, float]]) -> dict[str, float]:
    """The error of several shards together (the same keys as `error_stats`)."""
    sq_err, sq_ref = sum(s["sq_err"] for s in stats), sum(s["sq_ref"] for s in stats)
    return {
        "sq_err": sq_err, "sq_ref": sq_ref, "rms_rel": (sq_err / sq_ref) ** 0.5 if sq_ref else 0.0,
        "max_abs": max((s["max_abs"] for s in stats), default=0.0),
        "max_over_bound": max((s["max_over_bound"] for s in stats), default=0.0),
    }


def bytes_per_token(dtype: str, hidden: int) -> int:
    """Uncompressed bytes of one token's stored hidden state in store dtype `dtype` (codes plus the float32 scale
    of a lossy encoding)."""
    if is_lossy(dtype):
        return hidden + 4
    return hidden * torch.empty((), dtype=getattr(torch, dtype)).element_size()
