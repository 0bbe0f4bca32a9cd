"""Memory sizes written as text (22GiB, 512MiB, 24GB, 1.5e9), parsed to bytes where a config or a flag is read."""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

from preinfer.errors import UsageError

# Units of a memory size: decimal (GB = 10^9 bytes, as GPU memory is sold) and binary (GiB = 2^30 bytes).
SIZE_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
              "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
SIZE_PATTERN = re.compile(r"([0-9_]*\.?[0-9_]+(?:e[+-]?[0-9]{1,2})?)\s*([a-z]*)", re.IGNORECASE)


def parse_size(text: str | int | float) -> int:
    """Bytes (rounded down) of a size such as 22GiB, 512MiB, 24GB or 1.5e9; UsageError says what was expected."""
    expected = f"a size such as 22GiB, 512MiB, 24GB or 1.5e9, got '{text}'"
    match = SIZE_PATTERN.fullmatch(str(text).strip())
    if match is None or match.group(2).lower() not in SIZE_UNITS:
        raise UsageError(f"expected {expected}")
    try:
        value = int(Decimal(match.group(1)) * SIZE_UNITS[match.group(2).lower()])
    except InvalidOperation:  # digits the pattern lets through, such as a lone '_'
        raise UsageError(f"expected {expected}") from None
    if value < 1:
        raise UsageError(f"expected at least one byte, got '{text}'")
    return value
