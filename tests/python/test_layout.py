"""The package's layers, read from its imports: every import runs down the
layers that docs/architecture.md lists, no two modules import each other
(directly or around a cycle), and nothing below the package face reaches it.

The layers are read from the document itself, so that the document and the
code cannot drift apart: a move that adds an upward import fails here, and
the fix is either the import or the document (with its reason)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "python" / "zcore"
ARCHITECTURE = ROOT / "docs" / "architecture.md"


def module_files() -> dict[str, Path]:
    """Every module of the source tree by dotted name (a package by its own name)."""
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


MODULES = module_files()
KNOWN = set(MODULES) | {"zcore._C"}


def imported_modules(name: str, path: Path) -> set[str]:
    """The zcore modules ``name`` imports anywhere in its file (at the top,
    inside functions, under TYPE_CHECKING: each is a dependency)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.split(".")[0] == "zcore")
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parts, base] if base else parts)
            if base.split(".")[0] != "zcore":
                continue
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                out.add(sub if sub in KNOWN else base)
    return out


IMPORTS = {name: imported_modules(name, path) for name, path in MODULES.items()}


def unit(module: str) -> str:
    """What the layers list: a subpackage, a top-level module, or the face
    (``zcore``, the package's ``__init__``)."""
    parts = module.split(".")
    return "zcore" if len(parts) == 1 else parts[1]


def documented_layers() -> list[set[str]]:
    """The numbered list between the layers markers of docs/architecture.md,
    bottom first: each line's `names` are one layer."""
    text = ARCHITECTURE.read_text()
    found = re.search(r"<!-- layers -->(.*?)<!-- /layers -->", text, re.S)
    assert found, f"{ARCHITECTURE} has no '<!-- layers -->' ... '<!-- /layers -->' block"
    layers = []
    for line in found.group(1).splitlines():
        if re.match(r"\s*\d+\.\s", line):
            head = line.split(":", 1)[0]
            layers.append(set(re.findall(r"`([\w.]+)`", head)))
    return layers


def layer_of() -> dict[str, int]:
    index = {}
    for i, names in enumerate(documented_layers()):
        for name in names:
            assert name not in index, f"docs/architecture.md lists {name} on two layers"
            index[name] = i
    return index


def test_every_unit_is_on_a_documented_layer():
    index = layer_of()
    units = {unit(m) for m in KNOWN}
    assert sorted(units - set(index)) == [], "add them to the layers in docs/architecture.md"
    assert sorted(set(index) - units) == [], "docs/architecture.md lists layers the package no longer has"


def upward_imports(imports: dict[str, set[str]], index: dict[str, int]) -> list[str]:
    return sorted(
        f"{importer} imports {imported} (layer {index[unit(importer)]} -> {index[unit(imported)]})"
        for importer, targets in imports.items()
        for imported in targets
        if unit(importer) != unit(imported) and index[unit(imported)] >= index[unit(importer)]
    )


def test_imports_run_down_the_layers():
    assert upward_imports(IMPORTS, layer_of()) == []


def test_no_import_cycle():
    # Tarjan's strongly connected components over the module graph.
    order: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        order[v] = low[v] = len(order)
        stack.append(v)
        on_stack.add(v)
        for w in IMPORTS.get(v, ()):
            if w not in order:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], order[w])
        if low[v] == order[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for name in sorted(IMPORTS):
        if name not in order:
            visit(name)
    assert cycles == []


@pytest.mark.parametrize("module", sorted(m for m in MODULES if m != "zcore"))
def test_the_native_module_is_imported_directly(module):
    """``from zcore import _C`` runs through the package face, which imports
    the whole engine; ``import zcore._C as _C`` does not."""
    source = MODULES[module].read_text()
    assert not re.search(r"^\s*from zcore import [^\n]*\b_C\b", source, re.M)


def test_an_upward_import_is_reported(tmp_path):
    """The check above can fail: a memory module importing the engine (a
    lazy import inside a function counts too) is an upward import."""
    fake = tmp_path / "fake.py"
    fake.write_text("def f():\n    from zcore.engine import engine\n")
    imports = {"zcore.memory.fake": imported_modules("zcore.memory.fake", fake)}
    assert imports == {"zcore.memory.fake": {"zcore.engine.engine"}}
    assert upward_imports(imports, layer_of()) != []
