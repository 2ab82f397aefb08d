"""The import graph of `arl/` against docs/architecture.md's layer table: every import (at
module level and inside functions, read with `ast`, nothing imported) points to a row
below the importer's, and no modules import each other in a circle."""

from __future__ import annotations

import ast
import os
import re

import pytest

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_ARL = os.path.join(_ROOT, "arl")
_DOC = os.path.join(_ROOT, "docs", "architecture.md")
# Import circles known and being removed on another branch; each entry must still be a
# circle (the test below says when one is gone, so the entry goes with it).
def layer_table(doc_text: str) -> list[tuple[str, list[str]]]:
    """(layer name, its packages) for each row of the "## Layers" table, top row first."""
    section = doc_text.split("## Layers", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) < 3 or cells[0] in ("layer", "") or set(cells[0]) <= {"-", " "}:
            continue
        rows.append((cells[0], re.findall(r"`([\w./]+)`", cells[1])))
    return rows


def arl_modules(root: str = _ARL) -> dict[str, str]:
    """Dotted module name -> file path, for every .py file under `root` (a package's
    `__init__.py` named as the package)."""
    modules = {}
    base = os.path.dirname(root)
    for directory, _, files in os.walk(root):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(directory, name)
                dotted = os.path.relpath(path, base)[:-3].replace(os.sep, ".")
                modules[dotted.removesuffix(".__init__")] = path
    return modules


def imported_names(path: str, module: str, modules=()) -> set[str]:
    """Every module name an `import` or `from ... import` of the file names, wherever the
    statement stands (module level, inside functions or branches); a relative import
    resolved against `module`. `from pkg import x, y` names `pkg.x` and `pkg.y` where
    those are modules (in `modules`), and `pkg` too unless all of them are."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), filename=path)
    package = module if path.endswith("__init__.py") else module.rpartition(".")[0]
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1])
                source = f"{base}.{node.module}" if node.module else base
            else:
                source = node.module
            submodules = {f"{source}.{alias.name}" for alias in node.names} & set(modules)
            names.update(submodules)
            if len(submodules) < len(node.names):
                names.add(source)
    return names


def module_edges(modules: dict[str, str]) -> dict[str, set[str]]:
    """module -> the arl modules it imports, leaving out its own enclosing packages
    (Python runs them first whatever the module imports)."""
    return {module: {name for name in imported_names(path, module, modules)
                     if name in modules and name != module
                     and not module.startswith(name + ".")}
            for module, path in modules.items()}


def unit_of(module: str) -> str:
    """The package of the layer table a module belongs to: `arl.<first component>`."""
    return ".".join(module.split(".")[:2])


def circles(edges: dict[str, set[str]]) -> list[frozenset[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []
    counter = [0]

    def visit(node):
        index[node] = low[node] = counter[0]
        counter[0] += 1
        stack.append(node)
        on_stack.add(node)
        for target in sorted(edges.get(node, ())):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.add(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(frozenset(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return found


@pytest.fixture(scope="module")
def graph():
    with open(_DOC, encoding="utf-8") as f:
        table = layer_table(f.read())
    modules = arl_modules()
    return table, modules, module_edges(modules)


def test_every_arl_package_has_one_row(graph):
    table, modules, _ = graph
    listed = [package for _, packages in table for package in packages
              if package.startswith("arl.")]
    assert len(listed) == len(set(listed)), f"a package in two rows: {listed}"
    units = {unit_of(m) for m in modules if m != "arl"}
    assert units == set(listed), (
        f"packages without a row: {sorted(units - set(listed))}; rows naming no package: "
        f"{sorted(set(listed) - units)}")


def test_imports_point_to_lower_rows(graph):
    table, _, edges = graph
    row = {package: len(table) - i for i, (_, packages) in enumerate(table)
           for package in packages}
    upward = []
    for module, targets in edges.items():
        if module == "arl":  # the public face: names from every layer, loaded on first use
            continue
        for target in targets:
            source_unit, target_unit = unit_of(module), unit_of(target)
            if source_unit != target_unit and row[target_unit] >= row[source_unit]:
                upward.append(f"{module} -> {target}")
    assert not upward, "imports of a package of the same or a higher row:\n" + "\n".join(
        sorted(upward))


def test_arl_never_imports_the_entry_points(graph):
    _, modules, _ = graph
    offending = sorted(
        f"{module} -> {name}" for module, path in modules.items()
        for name in imported_names(path, module)
        if name.split(".")[0] in ("experiments", "configs", "benchmarks", "tests"))
    assert not offending, offending


def test_no_modules_import_each_other_in_a_circle(graph):
    _, _, edges = graph
    found = set(circles(edges))
    assert not found, sorted(sorted(c) for c in found)


def test_the_checks_catch_an_upward_import_a_circle_and_a_function_level_import(tmp_path):
    """The parsing behind the tests above, on a made-up tree: an import inside a function
    counts, a relative import resolves, and a two-module circle is found."""
    package = tmp_path / "arl"
    (package / "low").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "low" / "__init__.py").write_text("from arl.low import a\n")
    (package / "low" / "a.py").write_text("from . import b\n")
    (package / "low" / "b.py").write_text("def f():\n    from arl.low import a\n"
                                          "    import arl.high\n")
    (package / "high.py").write_text("from arl.low import b\n")
    modules = arl_modules(str(package))
    edges = module_edges(modules)
    assert edges["arl.low.a"] == {"arl.low.b"}
    assert edges["arl.low.b"] == {"arl.low.a", "arl.high"}
    assert edges["arl.high"] == {"arl.low.b"}
    assert set(circles(edges)) == {frozenset({"arl.low.a", "arl.low.b", "arl.high"})}
    table = layer_table("## Layers\n\n| layer | package | what |\n| --- | --- | --- |\n"
                        "| top | `arl.high` | x |\n| bottom | `arl.low` | y |\n\n## Next\n")
    assert table == [("top", ["arl.high"]), ("bottom", ["arl.low"])]


def test_arl_lists_its_real_subpackages(graph):
    """`arl.<name>` loads on first use for exactly the packages and modules of `arl/`."""
    import arl  # pylint: disable=import-outside-toplevel

    _, modules, _ = graph
    units = {unit_of(m).split(".")[1] for m in modules if m != "arl"}
    assert set(arl._SUBMODULES) == units  # pylint: disable=protected-access
    for name in sorted(units):
        assert getattr(arl, name).__name__ == f"arl.{name}"
