"""The import graph of `preinfer/`, `storage/` and `pipelines/`, read from the source with `ast` (imports inside
functions and under TYPE_CHECKING included): no cycle, the fixed dependency direction, the floors of `pipelines/`
(each imports only the floors below it), `pipelines/` and `bench/` using only `storage`'s public names, and every
public name of `storage` used by them or by the docs' Python."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import storage

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("preinfer", "storage", "pipelines")
# package -> the packages it may never import
FORBIDDEN = {"storage": ("preinfer", "pipelines"), "preinfer": ("storage", "pipelines")}
# The floors of `pipelines/`, lowest first (pipelines/__init__.py says what each holds): each floor's parts, by name,
# with the modules (and packages) each part holds. A module imports its own part and the parts of lower floors
# only: never a part beside it on its floor, never one above.
FLOORS: list[dict[str, tuple[str, ...]]] = [
    {"jobs": ("pipelines.jobs",), "progress": ("pipelines.progress",),
     "flags": ("pipelines.flag_types", "pipelines.flag_table", "pipelines.command_flags", "pipelines.flags")},
    {"models": ("pipelines.models",)},
    {"data": ("pipelines.data",)},
    {"cache": ("pipelines.cache",)},
    {"pre_inference": ("pipelines.pre_inference",)},
    {"pipeline_parallel": ("pipelines.pipeline_parallel",)},
    {"training": ("pipelines.training",), "store_training": ("pipelines.store_training",)},
    {"commands": ("pipelines.commands",)},
    {"cli": ("pipelines.cli",), "families_doc": ("pipelines.families_doc",)},
    {"reference": ("pipelines.reference",)},
]


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    """{dotted name: file} of every module of our packages."""
    return {module_name(p): p for package in PACKAGES for p in sorted((ROOT / package).rglob("*.py"))}


def imported_names(path: Path, name: str) -> list[tuple[str, list[str]]]:
    """(module, names imported from it) for every import statement in the file, relative ones resolved."""
    is_package = path.name == "__init__.py"
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(alias.name, []) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = name.split(".") if is_package else name.split(".")[:-1]
                anchor = package[: len(package) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            found.append((base, [alias.name for alias in node.names]))
    return found


def targets(imported: str, names: list[str], known: dict[str, Path]) -> list[str]:
    """The modules of ours an import statement loads: a `from m import sub` of a submodule loads `m.sub`."""
    if imported.split(".")[0] not in PACKAGES:
        return []
    out = [f"{imported}.{n}" for n in names if f"{imported}.{n}" in known]
    if len(out) < len(names) or not names:
        out.append(imported)
    return [t for t in out if t in known]


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: {t for imported, names in imported_names(path, name) for t in targets(imported, names, known)}
            for name, path in known.items()}


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a path [a, b, ..., a], or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state:
                cycle = visit(nxt)
                if cycle:
                    return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(edges):
        if node not in state:
            cycle = visit(node)
            if cycle:
                return cycle
    return None


def test_the_graph_is_read_from_every_module():
    edges = graph()
    assert {"storage.store", "storage.reader", "pipelines.cache.build", "preinfer.trainer"} <= set(edges)
    assert "storage.reader" in edges["storage.store"]  # a plain import
    assert "pipelines.cache.dask_runner" in edges["pipelines.cache.build"]  # `from pipelines.cache import dask_runner`


def test_find_cycle_finds_one_through_a_function_level_import():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None
    source = ROOT / "pipelines" / "cache" / "local_runner.py"
    lazy = [imported for imported, _ in imported_names(source, "pipelines.cache.local_runner")]
    assert "pipelines.cache.shards" in lazy


def test_no_import_cycle_in_our_packages():
    cycle = find_cycle(graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_dependency_direction():
    wrong = [f"{source} imports {target}" for source, targets_ in graph().items() for target in targets_
             if target.split(".")[0] in FORBIDDEN.get(source.split(".")[0], ())]
    assert wrong == []


def floor_of(module: str, floors: list[dict[str, tuple[str, ...]]] = FLOORS) -> tuple[int, str] | None:
    """(floor, part) of a module of `pipelines` (None: the package itself, which imports nothing)."""
    for level, parts in enumerate(floors):
        for part, holds in parts.items():
            if any(module == held or module.startswith(held + ".") for held in holds):
                return level, part
    return None


def floor_violations(edges: dict[str, set[str]], floors: list[dict[str, tuple[str, ...]]] = FLOORS) -> list[str]:
    """Each import of `pipelines` that points up a floor or across one, as 'a (floor part) imports b (part)'."""
    wrong = []
    for source, imported in sorted(edges.items()):
        mine = floor_of(source, floors) if source.startswith("pipelines.") else None
        for target in sorted(imported):
            theirs = floor_of(target, floors) if target.startswith("pipelines.") else None
            if mine and theirs and theirs[1] != mine[1] and theirs[0] >= mine[0]:
                wrong.append(f"{source} ({mine[1]}, floor {mine[0]}) imports {target} ({theirs[1]}, floor {theirs[0]})")
    return wrong


def test_the_floor_check_finds_an_import_up_and_one_across():
    floors = [{"low": ("pipelines.low",), "side": ("pipelines.side",)}, {"high": ("pipelines.high",)}]
    edges = {"pipelines.high.a": {"pipelines.low.b", "pipelines.high.c", "preinfer.x"},
             "pipelines.low.b": {"pipelines.high", "pipelines.low.d"}, "pipelines.side": {"pipelines.low.b"}}
    assert floor_violations(edges, floors) == [
        "pipelines.low.b (low, floor 0) imports pipelines.high (high, floor 1)",
        "pipelines.side (side, floor 0) imports pipelines.low.b (low, floor 0)"]


def test_every_module_of_pipelines_has_a_floor():
    assert [name for name in modules() if name.startswith("pipelines.") and floor_of(name) is None] == []


def test_no_import_points_up_a_floor():
    assert floor_violations(graph()) == []


def test_the_package_docstring_names_the_floors_in_order():
    import pipelines

    text = pipelines.__doc__
    names = [f"`{part}`" for parts in FLOORS for part in parts]
    assert all(name in text for name in names), [name for name in names if name not in text]
    firsts = [min(text.index(f"`{part}`") for part in parts) for parts in FLOORS]
    assert firsts == sorted(firsts)


def _private_store_names() -> set[str]:
    """The private attributes of storage's Store: its private methods and the `self._x` it assigns."""
    names = {n for n in dir(storage.Store) if n.startswith("_") and not n.startswith("__")}
    for node in ast.walk(ast.parse((ROOT / "storage" / "store.py").read_text())):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
            if node.attr.startswith("_") and not node.attr.startswith("__"):
                names.add(node.attr)
    return names


def test_pipelines_and_bench_use_only_storage_public_names():
    private = _private_store_names()
    files = [*sorted((ROOT / "pipelines").rglob("*.py")), *sorted((ROOT / "bench").rglob("*.py"))]
    problems = []
    for path in files:
        where = path.relative_to(ROOT)
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                problems += [f"{where}: import {a.name}" for a in node.names if a.name.startswith("storage.")]
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("storage"):
                if node.module != "storage":
                    problems.append(f"{where}: from {node.module} import ...")
                problems += [f"{where}: from storage import {a.name}" for a in node.names
                             if a.name.startswith("_") or a.name not in storage.__all__]
            elif isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
                owner = node.value
                if isinstance(owner, ast.Name) and owner.id == "storage":
                    problems.append(f"{where}:{node.lineno}: storage.{node.attr}")
                elif node.attr in private and not (isinstance(owner, ast.Name) and owner.id == "self"):
                    problems.append(f"{where}:{node.lineno}: .{node.attr} (private to storage.Store)")
    assert problems == []


def storage_names_used(source: str) -> set[str]:
    """The names a module's source takes from `storage`: `from storage import x` and `storage.x`."""
    used = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module == "storage":
            used |= {alias.name for alias in node.names}
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "storage":
            used.add(node.attr)
    return used


def python_examples() -> list[str]:
    """The ```python blocks of the README and the guides under docs/."""
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    return [block for page in pages for block in re.findall(r"```python\n(.*?)```", page.read_text(), re.S)]


def test_storage_names_used_reads_imports_and_attributes():
    source = "import storage\nfrom storage import a, b\nstorage.c(storage.d.e)"
    assert storage_names_used(source) == {"a", "b", "c", "d"}
    assert storage_names_used("from storage.errors import X\nfrom x import storage") == set()


def test_every_public_name_of_storage_has_a_user_outside_it():
    sources = [path.read_text() for path in [*(ROOT / "pipelines").rglob("*.py"), *(ROOT / "bench").rglob("*.py")]]
    used = set().union(*map(storage_names_used, sources + python_examples()))
    assert sorted(set(storage.__all__) - used) == [], "public names of storage that nothing outside it uses"


# The one run path may reach the pipeline only through the placement it asks for (`runner.placement_for`'s lazy
# import).
TRAINING_TO_PIPELINE = {"pipelines.training.runner": {"pipelines.pipeline_parallel.placement"}}


def test_training_and_the_pipeline_meet_only_at_the_seam():
    """`pipelines.pipeline_parallel` implements `preinfer.seams.Seams` without importing `pipelines.training`;
    `pipelines.training` reaches the pipeline through `placement_for` alone."""
    edges = graph()
    back = [f"{s} imports {t}" for s, ts in edges.items() if s.startswith("pipelines.pipeline_parallel")
            for t in ts if t.startswith("pipelines.training")]
    across = [f"{s} imports {t}" for s, ts in edges.items() if s.startswith("pipelines.training")
              for t in ts if t.startswith("pipelines.pipeline_parallel") and t not in TRAINING_TO_PIPELINE.get(s, ())]
    assert back == [] and across == []
    assert "preinfer.seams" in edges["pipelines.pipeline_parallel.stage"]
    assert not any(t.startswith("pipelines.pipeline_parallel") for t in edges["preinfer.trainer"])
