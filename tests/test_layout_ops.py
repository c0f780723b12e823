"""Layout guards for the op families and the TensorRT plumbing (docs/architecture.md): no private name is
imported from, or read off, another module under plan/, plugins/ and custom_ops/ (a module another one needs makes
it public), and the plan machinery (dtypes, launch plans, signatures) sits below both: it imports no other
project module, and plugins/ never reaches into custom_ops/ (custom_ops/trt_plugins.py registers the families'
plugins). Imports are resolved by the one scanner the package guards use (tests/import_graph.py)."""

from __future__ import annotations

import ast
from pathlib import Path

from import_graph import module_aliases, module_name, private_imports, project_imports

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("plan", "plugins", "custom_ops")
PLAN_LEAVES = {"k3x.plan.dtypes", "k3x.plan.launch", "k3x.plan.signature"}


def private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def private_uses(path: Path, root: Path = ROOT) -> list[str]:
    """Private names this file imports from project modules, or reads off an imported project module."""
    hits = [f"{line}: from {mod.removeprefix('k3x.')} import {n}" for line, mod, n in private_imports(path, root)]
    aliases = module_aliases(path, root)
    hits += [f"{n.lineno}: {n.value.id}.{n.attr}" for n in ast.walk(ast.parse(path.read_text()))
             if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id in aliases
             and private(n.attr)]
    return hits


def files() -> list[Path]:
    return sorted(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py"))


def test_no_private_name_imported_across_modules():
    hits = [f"{p.relative_to(ROOT)}:{h}" for p in files() for h in private_uses(p)]
    assert not hits, "private names used across modules (make them public where they are defined):\n" + \
        "\n".join(hits)


def test_the_private_name_guard_can_fail(tmp_path):
    pkg = tmp_path / "custom_ops" / "moe"
    pkg.mkdir(parents=True)
    (pkg / "triton.py").write_text("")
    fam = tmp_path / "custom_ops" / "fam"
    fam.mkdir()
    (fam / "triton.py").write_text("from ..moe.triton import _tile, tile_dot\nfrom ..moe import triton as dense\n"
                                   "x = dense._attrs(1)\ny = dense.aligned\n")
    assert private_uses(fam / "triton.py", tmp_path) == ["1: from custom_ops.moe.triton import _tile",
                                                         "3: dense._attrs"]


def test_the_plan_machinery_sits_below_ops_and_plugins():
    """dtypes, launch and signature import no other project module (so ops and plugins use them from below);
    plugins/ imports nothing from custom_ops/ (it sits below the families)."""
    up = [f"{p.relative_to(ROOT)}:{line}: {mod}" for p in files() if module_name(p, ROOT) in PLAN_LEAVES
          for _, line, mod in project_imports(p, ROOT) if mod not in PLAN_LEAVES]
    assert not up, "the plan machinery imports other project modules:\n" + "\n".join(up)
    back = [f"{p.relative_to(ROOT)}:{line}: {mod}" for p in (ROOT / "plugins").rglob("*.py")
            for _, line, mod in project_imports(p, ROOT) if mod.startswith("k3x.custom_ops")]
    assert not back, "plugins/ imports op-family modules:\n" + "\n".join(back)
