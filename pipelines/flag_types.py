"""The types that turn a flag's text into a value, or say in one line what they expected. Torch-free at import, so
that `preinfer plan` loads without torch; the definitions of the flags themselves are in `pipelines.flag_table`
and `pipelines.command_flags`."""

from __future__ import annotations

import argparse
from decimal import Decimal, InvalidOperation
from fractions import Fraction

from preinfer.block_lr import FLOAT32_MAX
from preinfer.errors import UsageError
from preinfer.sizes import parse_size

# Where CUDA builds of PyTorch come from (the tag names the CUDA version; pytorch.org lists the current ones).
CUDA_WHEELS = "https://download.pytorch.org/whl/cu128"


# The largest number a flag takes: for integers (sizes, counts, steps) the largest whole number a float holds
# exactly, for numbers float32's largest, so that no product of them overflows the planner's floats or becomes a
# step torch cannot hold in float32.
MAX_INT, MAX_FLOAT = 2**53, FLOAT32_MAX


def _number(text: str, kind: type, expected: str) -> int | float:
    try:
        return kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {expected}, got '{text}'") from None


def positive_int(text: str) -> int:
    """An integer > 0."""
    value = _number(text, int, "a positive integer")
    if not 1 <= value <= MAX_INT:
        raise argparse.ArgumentTypeError(f"expected a positive integer up to 2^53, got {text}")
    return value


def non_negative_int(text: str) -> int:
    """An integer >= 0."""
    value = _number(text, int, "an integer >= 0")
    if not 0 <= value <= MAX_INT:
        raise argparse.ArgumentTypeError(f"expected an integer in [0, 2^53], got {text}")
    return value


def positive_float(text: str) -> float:
    """A finite number > 0 (sizes such as GB, rates, ratios, epochs)."""
    value = _number(text, float, "a positive number")
    if not 0 < value <= MAX_FLOAT:
        raise argparse.ArgumentTypeError(f"expected a positive number up to 3.4e38 (float32's largest), got {text}")
    return value


def unit_fraction(text: str) -> float:
    """A fraction in (0, 1], written as 1/3 or 0.25 (UFP, MFU)."""
    try:
        value = Fraction(text.strip())
    except (ValueError, ZeroDivisionError):
        raise argparse.ArgumentTypeError(f"expected a fraction such as 1/3 or 0.25, got '{text}'") from None
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"{text} is outside (0, 1]")
    return float(value)


def token_count(text: str) -> int:
    """A whole number of tokens > 0: 1000000000, 1_000_000_000 or 1e9."""
    try:
        value = Decimal(text.strip())
    except InvalidOperation:
        raise argparse.ArgumentTypeError(f"expected a number of tokens such as 1e9 or 1_000_000_000, "
                                         f"got '{text}'") from None
    if not (value.is_finite() and 0 < value <= MAX_INT and value == value.to_integral_value()):
        raise argparse.ArgumentTypeError(f"expected a whole number of tokens in [1, 2^53], got {text}")
    return int(value)


def memory_size(text: str) -> int:
    """A memory size in bytes (`parse_size`)."""
    try:
        return parse_size(text)
    except UsageError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def float_pair(text: str) -> list[float]:
    """Two numbers separated by a comma, such as 0.9,0.95."""
    parts = text.split(",")
    expected = "two numbers such as 0.9,0.95"
    if len(parts) != 2:
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text}")
    return [_number(p, float, expected) for p in parts]


def device_problem(name: str) -> str | None:
    """Why this PyTorch cannot run on device `name` (cpu, cuda, cuda:1, ...), or None when it can.
    Imports torch: only the commands that run a model take --device."""
    import torch

    try:
        device = torch.device(name)
    except RuntimeError:
        return f"'{name}' is not a device such as cpu, cuda or cuda:1"
    if device.type != "cuda":
        return None
    if torch.version.cuda is None and torch.version.hip is None:
        return (f"PyTorch {torch.__version__} is a CPU-only build; install a CUDA build, e.g. "
                f"pip install --force-reinstall torch --index-url {CUDA_WHEELS} (see README: GPUs)")
    count = torch.cuda.device_count()
    if count == 0:
        return f"PyTorch {torch.__version__} sees no CUDA device"
    if device.index is not None and device.index >= count:
        return f"{name} does not exist: PyTorch {torch.__version__} sees {count} CUDA device(s)"
    return None


def device(text: str) -> str:
    """A device this PyTorch can run on."""
    problem = device_problem(text)
    if problem:
        raise argparse.ArgumentTypeError(problem)
    return text


def store_location(text: str) -> str:
    """Where a store or cache is read or written: a local path, or a URL of a scheme stores support (s3://,
    memory://); any other scheme is refused rather than taken for a local directory."""
    from storage import StorageError, location  # storage imports torch: only commands with store flags get here

    try:
        location(text)
    except StorageError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    return text


def local_directory(text: str) -> str:
    """A local directory (a run directory holds checkpoints and metrics on a local disk); refuses URLs."""
    scheme, sep, _ = text.partition("://")
    if sep and scheme != "file":
        raise argparse.ArgumentTypeError(f"{text}: a run directory must be a local path (only stores may be URLs)")
    return text.removeprefix("file://")
