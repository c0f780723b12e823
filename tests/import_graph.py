"""The project-import graph of the k3x sources, for the layout guards (tests/test_layout.py): which project
module each import statement names (absolute or relative, top- or function-level, TYPE_CHECKING included),
the package order imports must follow, and cycles between packages."""

from __future__ import annotations

import ast
from pathlib import Path

# bottom first: a module may import its own package or one listed before it. cli.py (with its flag types,
# cli_flags.py) and __main__ are the top. "" is the root package (__version__ only); console.py (what commands
# print) imports no project module.
PACKAGE_ORDER: tuple[tuple[str, ...], ...] = (
    ("", "fileio", "console"), ("plan",), ("plugins",), ("custom_ops",), ("model",), ("text",), ("checkpoint",), ("folder",),
    ("exporter",), ("runtime",), ("bench",), ("server",), ("cli", "cli_flags", "__main__"),
)


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(["k3x", *parts])


def package(mod: str) -> str:
    parts = mod.split(".")
    return parts[1] if len(parts) > 1 else ""


def layer(mod: str) -> int:
    top = package(mod)
    for i, group in enumerate(PACKAGE_ORDER):
        if top in group:
            return i
    raise KeyError(f"{mod}: its package {top!r} is not in PACKAGE_ORDER (tests/import_graph.py): place it")


def _targets(node: ast.ImportFrom | ast.Import, mod: str, is_pkg: bool, root: Path) -> list[tuple[str, str | None]]:
    """[(project module, imported name or None)] named by one import statement."""
    if isinstance(node, ast.Import):
        return [(a.name, None) for a in node.names if a.name.split(".")[0] == "k3x"]
    if node.level:
        base = mod.split(".") if is_pkg else mod.split(".")[:-1]
        base = base[:len(base) - (node.level - 1)] + ([node.module] if node.module else [])
    else:
        base = (node.module or "").split(".")
    if base[0] != "k3x":
        return []
    folder = root.joinpath(*base[1:])
    return [(".".join([*base, a.name]), None) if (folder / f"{a.name}.py").is_file()
            or (folder / a.name / "__init__.py").is_file() else (".".join(base), a.name) for a in node.names]


def _imports(path: Path, root: Path) -> list[tuple[str, int, str, str | None]]:
    mod = module_name(path, root)
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            out += [(mod, node.lineno, t, n) for t, n in _targets(node, mod, path.name == "__init__.py", root)]
    return out


def project_imports(path: Path, root: Path) -> list[tuple[str, int, str]]:
    """(this module, line, imported project module) for every import in `path` (the root `k3x` excluded:
    it holds only the version)."""
    return sorted({(m, line, t) for m, line, t, _ in _imports(path, root) if t != "k3x" and t != m})


def private_imports(path: Path, root: Path) -> list[tuple[int, str, str]]:
    """(line, module, name) of every `from <another project module> import _name` (dunders allowed)."""
    return [(line, t, n) for m, line, t, n in _imports(path, root)
            if n and n.startswith("_") and not n.startswith("__") and t != m]


def module_aliases(path: Path, root: Path) -> set[str]:
    """Local names `path` binds to project modules (`from . import triton as kt` -> "kt")."""
    mod = module_name(path, root)
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            for a, (_, name) in zip(node.names, _targets(node, mod, path.name == "__init__.py", root)):
                if name is None:
                    names.add(a.asname or a.name)
    return names


def package_cycles(edges: list[tuple[str, int, str]]) -> list[list[str]]:
    """Groups of two or more packages that import each other (strongly connected components)."""
    return _cycles([(package(mod), package(target)) for mod, _, target in edges])


def module_cycles(edges: list[tuple[str, int, str]]) -> list[list[str]]:
    """Groups of two or more modules that import each other, function-level imports included (an import
    inside a function that closes a circle only hides it until the function runs)."""
    return _cycles([(mod, target) for mod, _, target in edges])


def _cycles(pairs: list[tuple[str, str]]) -> list[list[str]]:
    graph: dict[str, set[str]] = {}
    for a, b in pairs:
        if a != b:
            graph.setdefault(a, set()).add(b)
            graph.setdefault(b, set())
    reach = {v: _reachable(graph, v) for v in graph}
    comps = {frozenset(w for w in reach[v] if v in reach[w]) | {v} for v in graph}
    return sorted(sorted(c) for c in comps if len(c) > 1)


def _reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for w in graph[todo.pop()]:
            if w not in seen:
                seen.add(w)
                todo.append(w)
    return seen
