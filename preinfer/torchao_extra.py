"""The optional torchao extra (`pip install preinfer[quant]`), imported only when a run asks for it: importing it
prints warnings and takes seconds, so nothing imports it at import time."""

from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType

from preinfer.errors import UsageError


def torchao_module(name: str, wanted: str) -> ModuleType:
    """torchao's module `name`, or a UsageError naming `wanted` (what needs it) and the extra to install."""
    try:
        return importlib.import_module(name)
    except ImportError:
        raise UsageError(f"{wanted} needs torchao, which is not installed: pip install preinfer[quant]") from None


def torchao_installed() -> bool:
    """Whether torchao can be imported (found without importing it)."""
    return importlib.util.find_spec("torchao") is not None
