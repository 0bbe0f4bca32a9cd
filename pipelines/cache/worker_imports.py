"""Our packages imported correctly on Dask workers: the `ImportOurPackages` worker plugin.

A worker started by the `dask worker` CLI puts its local directory (`dask-scratch-space/worker-XXXX`) first on
`sys.path` and keeps its spill files in a subdirectory of it named `storage`. With this distribution installed
editable, setuptools' finder sits on `sys.meta_path` after the `PathFinder`, so `import storage` finds that empty
directory first and makes it a namespace package ("cannot import name 'Store' from 'storage' (unknown
location)"). The plugin, registered by the client before any task is sent, imports our packages on every worker
(also on workers that join later) with such shadowing `sys.path` entries left out; the modules then stay in
`sys.modules` for the tasks. It is pickled by value, so that a worker needs none of our modules to unpickle it.
"""

from __future__ import annotations

import importlib
import os
import sys
from typing import Any

PACKAGES = ("storage", "preinfer", "pipelines")


def _shadows(entry: str, name: str) -> bool:
    """Whether the sys.path `entry` holds a directory `name` that is not a regular package (a namespace portion)."""
    folder = os.path.join(entry or os.getcwd(), name)
    return os.path.isdir(folder) and not os.path.isfile(os.path.join(folder, "__init__.py"))


def import_packages(names: tuple[str, ...] = PACKAGES) -> None:
    """Import `names` as the installed packages, whatever directories of the same names are on sys.path; a
    namespace package imported before under one of these names is dropped first."""
    for name in names:
        module = sys.modules.get(name)
        if module is not None and getattr(module, "__file__", None) is None:
            for key in [k for k in sys.modules if k == name or k.startswith(name + ".")]:
                del sys.modules[key]
    saved = list(sys.path)
    sys.path[:] = [entry for entry in saved if not any(_shadows(entry, name) for name in names)]
    importlib.invalidate_caches()
    try:
        for name in names:
            importlib.import_module(name)
    finally:
        sys.path[:] = saved


def worker_plugin() -> Any:
    """An `ImportOurPackages` plugin (a `distributed.WorkerPlugin`) that pickles by value."""
    import cloudpickle
    from distributed import WorkerPlugin

    class ImportOurPackages(WorkerPlugin):
        """Imports our packages on a worker before it runs any task of ours."""

        name = "preinfer-import-packages"
        idempotent = True

        def setup(self, worker: Any) -> None:
            import_packages()

    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    return ImportOurPackages()
