"""The optional Liger Kernel extra (`pip install preinfer[liger]`, `--loss liger`): found without importing it (it
imports Triton), so that the config's rules stay torch-free."""

from __future__ import annotations

import importlib.util


def liger_installed() -> bool:
    """Whether Liger Kernel can be imported (found without importing it)."""
    return importlib.util.find_spec("liger_kernel") is not None
