"""Every error the project raises derives from one of its two roots, `preinfer.errors.PreinferError` (the model side
and `pipelines`) and `storage.errors.StorageError` (the storage side), read from the source with `ast`: no builtin
exception class is raised, returned or subclassed outside a short list of Python protocols; every exception class of
ours hangs from those two or from `RunStopped` (a run stopped by a signal, which is no error); and the CLI turns the
errors into one line and an exit code (2 for bad input, 1 at run time)."""

from __future__ import annotations

import ast
import builtins
import importlib
from pathlib import Path

import pytest

import pipelines.commands.plan as plan_command
from pipelines.cache.result import CacheJobError
from pipelines.cache.shards import NonFiniteStates
from pipelines.cli import main
from pipelines.data.batches import NoBatchesError
from pipelines.data.token_store.staging import StagingError
from pipelines.training.signals import RunStopped
from preinfer.errors import BoundaryStateError, PreinferError, UsageError
from storage import StorageError

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("preinfer", "storage", "pipelines")
BUILTIN_ERRORS = {name for name, value in vars(builtins).items()
                  if isinstance(value, type) and issubclass(value, BaseException)}
# (file, function, builtin) -> why the builtin is the right one there: a protocol of Python or of our own interface.
ALLOWED = {
    ("preinfer/__init__.py", "__getattr__", "AttributeError"):
        "a module's __getattr__ (PEP 562) raises AttributeError: getattr, hasattr and `from preinfer import x` "
        "rely on it",
    ("storage/blobs.py", "MemoryBlobs.read", "FileNotFoundError"):
        "Blobs.read's contract: a missing blob raises FileNotFoundError, as a missing file (LocalBlobs) and a missing "
        "fsspec object (FsspecBlobs) do; its callers catch exactly that",
    ("pipelines/data/in_memory.py", "TokenDataset.__getitem__", "IndexError"):
        "the sequence protocol: an index out of range is an IndexError (iteration by index stops on it)",
    ("pipelines/data/token_store/dataset.py", "TokenStoreDataset._positions", "IndexError"):
        "the index check of TokenStoreDataset.__getitem__: the sequence protocol's IndexError",
    ("pipelines/data/token_store/dataset.py", "TokenStoreDataset._positions", "TypeError"):
        "the index check of TokenStoreDataset.__getitem__: an index of the wrong type is a TypeError, as for a list",
    ("preinfer/atomic_write.py", "_raise_publish_error", "OSError"):
        "the atomic writes' contract: a failed publish is an OSError of the disk's error number naming the path "
        "published (also where a writer reported one in its text: safetensors' 'os error 28'), which every job's "
        "handler of OSError turns into its one line with the remedy",
    ("pipelines/training/signals.py", "RunStopped", "SystemExit"):
        "not an error: a run stopped by a signal after its checkpoint exits with 128 + the signal's number, and a "
        "SystemExit ends the interpreter with that code from every command",
}
# The two roots themselves derive from Exception.
ROOTS = {("preinfer/errors.py", "PreinferError"), ("storage/errors.py", "StorageError")}


def _builtin_name(node: ast.expr) -> str | None:
    return node.id if isinstance(node, ast.Name) and node.id in BUILTIN_ERRORS else None


class BuiltinErrors(ast.NodeVisitor):
    """Collects (function, builtin, what) for each builtin exception class a module raises, constructs or
    subclasses; `function` is the enclosing qualified name ('' at module level)."""

    def __init__(self) -> None:
        self.scope: list[str] = []
        self.found: list[tuple[str, str, str]] = []

    def _nested(self, node: ast.AST) -> None:
        self.scope.append(node.name)
        self.generic_visit(node)
        self.scope.pop()

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        for base in node.bases:
            name = _builtin_name(base)
            if name:
                self.found.append((".".join(self.scope + [node.name]), name, "subclassed"))
        self._nested(node)

    visit_FunctionDef = visit_AsyncFunctionDef = _nested

    def visit_Raise(self, node: ast.Raise) -> None:
        name = node.exc is not None and _builtin_name(node.exc)
        if name:  # `raise ValueError` without a call
            self.found.append((".".join(self.scope), name, "raised"))
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        name = _builtin_name(node.func)
        if name:
            self.found.append((".".join(self.scope), name, "raised"))
        self.generic_visit(node)


def builtin_errors(source: str) -> list[tuple[str, str, str]]:
    visitor = BuiltinErrors()
    visitor.visit(ast.parse(source))
    return visitor.found


def test_the_scan_finds_raises_returns_and_subclasses_of_builtins():
    source = '''
class Mine(ValueError):
    pass
class Fine(SomeError):
    def check(self):
        raise KeyError("x") from None
def stopped():
    if True:
        return RuntimeError("y")
    raise StopIteration
try:
    pass
except OSError:
    raise
'''
    assert builtin_errors(source) == [("Mine", "ValueError", "subclassed"), ("Fine.check", "KeyError", "raised"),
                                      ("stopped", "RuntimeError", "raised"), ("stopped", "StopIteration", "raised")]


def test_no_builtin_exception_outside_the_protocols():
    found, used = [], set()
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            where = path.relative_to(ROOT).as_posix()
            for function, name, what in builtin_errors(path.read_text()):
                if (where, function, name) in ALLOWED:
                    used.add((where, function, name))
                elif not (what == "subclassed" and name == "Exception" and (where, function) in ROOTS):
                    found.append(f"{where}: {function or '<module>'} {what} {name}")
    assert found == [], "raise one of our errors (PreinferError or StorageError and their subclasses) instead"
    assert used == set(ALLOWED), "entries of ALLOWED that no longer match the source"


def test_the_two_roots_are_apart():
    assert not issubclass(PreinferError, StorageError) and not issubclass(StorageError, PreinferError)


def our_exception_classes() -> set[type]:
    """Every exception class defined in our packages (each of their modules imported)."""
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            importlib.import_module(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    found, todo = set(), [BaseException]
    while todo:
        cls = todo.pop()
        todo += cls.__subclasses__()
        if cls.__module__.split(".")[0] in PACKAGES:
            found.add(cls)
    return found


def test_our_exceptions_hang_from_three_roots():
    ours = our_exception_classes()
    roots = {cls for cls in ours if not any(base in ours for base in cls.__bases__)}
    assert roots == {PreinferError, StorageError, RunStopped}
    assert len(ours) > 20  # the walk found the subclasses


@pytest.mark.parametrize("error, code", [
    (BoundaryStateError("layer range [0, 9) is outside [0, 4]"), 1),
    (NonFiniteStates("train shard 1 (samples 4..8): the boundary states hold NaN"), 1),
    (CacheJobError("the cache writer thread stopped"), 1),
    (NoBatchesError("store s yields no batches"), 1),
    (StagingError("chunk 3 is not staged in out/staging"), 1),
    (StorageError("store s: shard 9 out of range"), 1),
    (UsageError("[blocks] memory_budget: expected a size such as 22GiB"), 2),
])
def test_the_cli_ends_on_our_errors_with_one_line_and_the_exit_code(monkeypatch, capsys, error, code):
    def fail(args):
        raise error

    monkeypatch.setattr(plan_command, "run", fail)
    assert main(["plan", "--model", "7b"]) == code
    assert capsys.readouterr().err == f"preinfer plan: error: {error}\n"
