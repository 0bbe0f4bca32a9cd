"""The tests' own layout: what they share lives in conftest.py or tests/helpers/, so no test module imports another
(a test module is run, collected and changed on its own)."""

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent
TEST_MODULES = {path.stem for path in TESTS.rglob("test_*.py")}
# The packages a test module sits in (`tests`, `tests.contract`, ...): a dotted name's leading parts, passed over.
TEST_PACKAGES = {"tests"} | {path.name for path in TESTS.rglob("*") if path.is_dir() and path.name != "__pycache__"}


def imported_modules(tree: ast.Module) -> list[str]:
    """The dotted names of the modules a file imports, a `from X import Y` counting both X and X.Y."""
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = "." * node.level + (node.module or "")
            names.append(base)
            names += [f"{base}.{alias.name}" if node.module else base + alias.name for alias in node.names]
    return names


def imports_of_test_modules(names: list[str], test_modules: set[str] = TEST_MODULES) -> set[str]:
    """The test modules that `names` import (`test_x`, `test_x.Y`, `tests.test_x`, `.test_x`, and one in a package
    of the tests: `tests.contract.test_x`, `..contract.test_x`)."""
    modules = set()
    for name in names:
        parts = name.lstrip(".").split(".")
        while len(parts) > 1 and parts[0] in TEST_PACKAGES:
            parts.pop(0)
        modules.add(parts[0])
    return modules & test_modules


def test_the_check_sees_every_spelling_of_a_test_module_import():
    source = """
import test_cache
from test_data import CORPUS
from tests.test_trainer import make_trainer
from tests import test_from_store
from . import test_moe
from .test_ranks import MEASURED
from tests.contract.test_ownership import hold
from ..contract import test_properties
from .contract.test_inputs import CASES
def inner():
    from test_pipeline import torchrun
import tests.helpers.cache_jobs
from tests.helpers.trainers import snapshot
"""
    expected = {"test_cache", "test_data", "test_trainer", "test_from_store", "test_moe", "test_ranks", "test_pipeline",
                "test_ownership", "test_properties", "test_inputs"}
    assert imports_of_test_modules(imported_modules(ast.parse(source)), expected | {"test_other"}) == expected


def test_no_file_of_the_tests_imports_a_test_module():
    offenders = {}
    for path in sorted(TESTS.rglob("*.py")):
        imported = imports_of_test_modules(imported_modules(ast.parse(path.read_text(encoding="utf-8"))))
        if imported:
            offenders[str(path.relative_to(TESTS))] = sorted(imported)
    assert not offenders, f"move what these share to tests/helpers/: {offenders}"
