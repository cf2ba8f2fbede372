"""The package's shape, checked: imports run one way, the library knows nothing of Flower,
and no module grows past the size where it starts mixing concerns (issue 17)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
#: the user's top-level layers, installed as subpackages of fedfuse (pyproject's package-dir)
MAPPED = {
    "strategies": "fedfuse.strategies",
    "clients": "fedfuse.clients",
    "partitions": "fedfuse.partitions",
    "configs": "fedfuse.configs",
}
#: the Flower-free library: it may import nothing from the layers above it
LIBRARY = ("fedfuse.models", "fedfuse.data", "fedfuse.fusion", "fedfuse.training", "fedfuse.io")
ABOVE_LIBRARY = (
    "fedfuse.federation",
    "fedfuse.strategies",
    "fedfuse.clients",
    "fedfuse.experiments",
    "fedfuse.cli",
    "fedfuse.deploy",
    "flwr",
)
MAX_LINES = 500
#: the largest share of the package's lines that one folder's own files may hold (issue 51)
MAX_FOLDER_SHARE = 0.15


def _modules() -> dict[str, Path]:
    found = {}
    for path in sorted((ROOT / "fedfuse").rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    for folder, package in MAPPED.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            name = ".".join((package, *(parts[:-1] if parts[-1] == "__init__" else parts)))
            found[name] = path
    return found


MODULES = _modules()


def _imports(name: str, path: Path) -> set[str]:
    """Every fedfuse module (or flwr) that ``name`` imports, at any depth of its code."""
    is_package = path.name == "__init__.py"
    package = name if is_package else name.rpartition(".")[0]
    targets: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            targets.add(base)
            targets.update(f"{base}.{alias.name}" for alias in node.names)
    resolved = set()
    for target in targets:
        if target.split(".")[0] == "flwr":
            resolved.add("flwr")
        elif target in MODULES and target != name:
            resolved.add(target)
    return resolved


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def _cycles() -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in GRAPH.get(node, ()):
            if nxt == "flwr" or nxt not in GRAPH:
                continue
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for node in GRAPH:
        if node not in index:
            visit(node)
    return components


def _is_package_face(name: str) -> bool:
    return MODULES[name].name == "__init__.py"


def test_no_import_circles() -> None:
    # a package's __init__ re-exporting its children is not a circle of concepts: leave faces out
    faces = {name for name in GRAPH if _is_package_face(name)}
    saved = dict(GRAPH)
    try:
        for name in list(GRAPH):
            GRAPH[name] = {t for t in saved[name] if t not in faces or t == name}
        assert _cycles() == []
    finally:
        GRAPH.update(saved)


@pytest.mark.parametrize("layer", LIBRARY)
def test_the_library_imports_nothing_above_it(layer: str) -> None:
    upward = sorted(
        f"{name} -> {target}"
        for name, targets in GRAPH.items()
        if name == layer or name.startswith(layer + ".")
        for target in targets
        if any(target == above or target.startswith(above + ".") for above in ABOVE_LIBRARY)
    )
    assert upward == []


def test_no_module_over_500_lines() -> None:
    large = {
        str(path.relative_to(ROOT)): n
        for path in MODULES.values()
        if (n := len(path.read_text().splitlines())) > MAX_LINES
    }
    assert large == {}


def test_no_folder_holds_more_than_its_share_of_the_package() -> None:
    """A folder whose own files (its subfolders apart) hold much of the package mixes the
    concepts that its subpackages would name: split it by family instead."""
    lines: dict[Path, int] = {}
    for path in MODULES.values():
        lines[path.parent] = lines.get(path.parent, 0) + len(path.read_text().splitlines())
    total = sum(lines.values())
    crowded = {
        str(folder.relative_to(ROOT)): round(n / total, 3)
        for folder, n in lines.items()
        if n > MAX_FOLDER_SHARE * total
    }
    assert crowded == {}


def test_every_package_is_installed() -> None:
    """pyproject lists packages by name (the layers map into fedfuse): a new subpackage that is
    not listed would be missing from the wheel and from every non-editable install."""
    import tomllib

    listed = set(
        tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    )
    packages = {name for name, path in MODULES.items() if path.name == "__init__.py"}
    assert packages - listed == set()


#: fedfuse's floors from the ground up (README's Layout): a folder imports only from lower ones.
#: partitions and configs import nothing of fedfuse; strategies sit on clients (the record format).
FLOORS = (
    ("fedfuse.runtime", "fedfuse.partitions", "fedfuse.configs"),
    ("fedfuse.models",),
    ("fedfuse.io",),
    ("fedfuse.data",),
    ("fedfuse.training",),
    ("fedfuse.fusion",),
    ("fedfuse.settings",),
    ("fedfuse.federation",),
    ("fedfuse.experiments", "fedfuse.deploy", "fedfuse.clients"),
    ("fedfuse.strategies",),
    ("fedfuse.cli",),
)


def _floor(module: str) -> int | None:
    for level, packages in enumerate(FLOORS):
        if any(module == p or module.startswith(p + ".") for p in packages):
            return level
    return None


def test_every_folder_has_a_floor() -> None:
    assert sorted(n for n in MODULES if n != "fedfuse" and _floor(n) is None) == []


def test_imports_run_down_the_floors() -> None:
    upward = sorted(
        f"{name} -> {target}"
        for name, targets in GRAPH.items()
        for target in targets
        if target not in ("flwr", "fedfuse")
        and (a := _floor(name)) is not None
        and (b := _floor(target)) is not None
        and b > a
    )
    assert upward == []
