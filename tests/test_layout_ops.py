"""Layout guards for the op families and the TensorRT plumbing (docs/architecture.md): no private name is
imported from another module under plan/, trt/ and custom_ops/ (a module another one needs makes it public),
and the plan machinery (dtypes, launch plans, signatures) sits below both: it imports no other project
module, and trt/ never reaches into custom_ops/ (custom_ops/trt_plugins.py registers the families' plugins)."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("plan", "trt", "custom_ops")
PLAN_LEAVES = {"plan.dtypes", "plan.launch", "plan.signature"}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def project_imports(path: Path) -> list[tuple[int, str, list[str]]]:
    """(line, imported module relative to the repository root, names) of every project import in `path`."""
    package = module_name(path).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    out = []
    for n in ast.walk(ast.parse(path.read_text())):
        if isinstance(n, ast.ImportFrom):
            if n.level:
                base = package[:len(package) - n.level + 1] + (n.module.split(".") if n.module else [])
            elif (n.module or "").split(".")[0] == "k3x":
                base = n.module.split(".")[1:]
            else:
                continue
            out.append((n.lineno, ".".join(base), [a.name for a in n.names]))
        elif isinstance(n, ast.Import):
            out += [(n.lineno, a.name.removeprefix("k3x."), []) for a in n.names if a.name.startswith("k3x.")]
    return out


def private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def private_uses(path: Path) -> list[str]:
    """Private names this file imports from project modules, or reads off an imported project module."""
    hits, modules = [], set()
    for line, mod, names in project_imports(path):
        hits += [f"{line}: from {mod} import {n}" for n in names if private(n)]
        modules |= set(names)  # `from . import triton as kt` binds a module under its alias below
    aliases = {a.asname or a.name for n in ast.walk(ast.parse(path.read_text()))
               if isinstance(n, ast.ImportFrom) for a in n.names if a.name in modules}
    for n in ast.walk(ast.parse(path.read_text())):
        if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id in aliases \
                and private(n.attr):
            hits.append(f"{n.lineno}: {n.value.id}.{n.attr}")
    return hits


def files() -> list[Path]:
    return sorted(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py"))


def test_no_private_name_imported_across_modules():
    hits = [f"{p.relative_to(ROOT)}:{h}" for p in files() for h in private_uses(p)]
    assert not hits, "private names used across modules (make them public where they are defined):\n" + \
        "\n".join(hits)


def test_the_private_name_guard_can_fail(tmp_path, monkeypatch):
    pkg = tmp_path / "custom_ops" / "fam"
    pkg.mkdir(parents=True)
    (pkg / "triton.py").write_text("from ..moe.triton import _tile, tile_dot\nfrom ..moe import triton as dense\n"
                                   "x = dense._attrs(1)\ny = dense.aligned\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert private_uses(pkg / "triton.py") == ["1: from custom_ops.moe.triton import _tile", "3: dense._attrs"]


def test_the_plan_machinery_sits_below_ops_and_plugins():
    """dtypes, launch and signature import no other project module (so ops and plugins use them from below);
    trt/ imports nothing from custom_ops/ (it sits below the families)."""
    up = [f"{p.relative_to(ROOT)}:{line}: {mod}" for p in files() if module_name(p) in PLAN_LEAVES
          for line, mod, _ in project_imports(p) if mod not in PLAN_LEAVES]
    assert not up, "the plan machinery imports other project modules:\n" + "\n".join(up)
    back = [f"{p.relative_to(ROOT)}:{line}: {mod}" for p in (ROOT / "trt").rglob("*.py")
            for line, mod, _ in project_imports(p) if mod.startswith("custom_ops")]
    assert not back, "trt/ imports op-family modules:\n" + "\n".join(back)
