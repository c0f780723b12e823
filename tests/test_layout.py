"""Layout guards (docs/architecture.md): every op family has every role; reference and kernels never import
each other; no module outside custom_ops/ names a family (the model definition, checkpoint names and
benchmarks excepted); imports point one way between packages (PACKAGE_ORDER: none back up, no cycle across
packages); no private name is imported from another module; no non-kernel source file passes 400 lines;
nothing points outside the repository."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from import_graph import PACKAGE_ORDER, layer, module_cycles, package_cycles, private_imports, project_imports

import pytest

from k3x.custom_ops.registry import FAMILIES, Family

ROOT = Path(__file__).resolve().parents[1]
ROLES = ("__init__.py", "op.py", "reference.py", "triton.py", "onnx.py", "plugin.py")
GPU_ROLES = ("triton.py", "plugin.py")  # none in a CPU-only family (registry.CPU_ONLY)
MAX_LINES = 400
KERNEL_FILES = {f"custom_ops/{f}/triton.py" for f in FAMILIES}


def sources() -> list[Path]:
    skip = {".venv", ".git", "tests", "build", "runs", "docs"}
    return sorted(p for p in ROOT.rglob("*.py") if not skip & set(p.relative_to(ROOT).parts[:1]))


def family_words() -> re.Pattern:
    from k3x.custom_ops.registry import families

    names = set(FAMILIES) | {f.onnx.NODE.op_type for f in families()}
    return re.compile(r"\b(" + "|".join(sorted(names)) + r")\b", re.I)


def code_tokens(path: Path) -> list[tuple[int, str]]:
    """(line, text) of every identifier, attribute and string constant that is not a docstring."""
    tree = ast.parse(path.read_text())
    docstrings = {id(n.body[0].value) for n in ast.walk(tree)
                  if isinstance(n, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and n.body
                  and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
    out = []
    for n in ast.walk(tree):
        if isinstance(n, ast.Name):
            out.append((n.lineno, n.id))
        elif isinstance(n, ast.Attribute):
            out.append((n.lineno, n.attr))
        elif isinstance(n, ast.alias):
            out.append((getattr(n, "lineno", 0), n.name))
        elif isinstance(n, ast.arg):
            out.append((n.lineno, n.arg))
        elif isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docstrings:
            out.append((n.lineno, n.value))
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_has_every_role(family):
    """Every role, but a CPU-only family has no GPU role (and so nothing a plugin registration could load)."""
    folder = ROOT / "custom_ops" / family
    gpu = Family(family).gpu
    missing = [r for r in ROLES if not (folder / r).is_file() and (gpu or r not in GPU_ROLES)]
    assert not missing, f"custom_ops/{family} lacks {missing} (docs/architecture.md, 'Adding an op family')"
    extra = [r for r in GPU_ROLES if not gpu and (folder / r).exists()]
    assert not extra, f"custom_ops/{family} is CPU-only (registry.CPU_ONLY) but has {extra}"
    for a, b in (("reference.py", "triton"), ("triton.py", "reference")):
        if not (folder / a).is_file():
            continue
        imports = [t for _, t in code_tokens(folder / a) if t == b or t.endswith(f".{b}")]
        assert not imports, f"custom_ops/{family}/{a} imports {b}"


def test_no_module_outside_custom_ops_names_a_family():
    """exporter/, runtime/, plugins/, cli.py and the other top-level modules iterate the registry instead."""
    words = family_words()
    # the ops themselves, the model definition, checkpoint names (config.json's and the tensors'), benchmarks
    exempt = ("custom_ops", "model", "checkpoint", "bench")
    hits = [f"{p.relative_to(ROOT)}:{line}: {text!r}" for p in sources()
            if p.relative_to(ROOT).parts[0] not in exempt for line, text in code_tokens(p) if words.search(text)]
    assert not hits, "modules outside custom_ops/ name an op family:\n" + "\n".join(hits)


def test_the_guard_sees_a_family_name(tmp_path):
    """The scan above can fail: a module naming `k3::kda` in code is caught (docstrings are free)."""
    src = tmp_path / "probe.py"
    src.write_text('"""doc mentions kda freely."""\nOP = "k3::kda"\n')
    assert [t for _, t in code_tokens(src) if family_words().search(t)] == ["k3::kda"]


def test_non_kernel_files_stay_small():
    big = [f"{p.relative_to(ROOT)}: {n} lines" for p in sources()
           if str(p.relative_to(ROOT)) not in KERNEL_FILES and (n := len(p.read_text().splitlines())) > MAX_LINES]
    assert not big, f"non-kernel files over {MAX_LINES} lines (split them by concern):\n" + "\n".join(big)


def test_every_package_is_installed():
    """A regular (non-editable) install ships exactly the packages pyproject.toml lists: a new op family's
    folder must be listed there too."""
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(("k3x", *p.parent.relative_to(ROOT).parts)) for p in ROOT.rglob("__init__.py")
             if not {".venv", ".git", "tests", "build"} & set(p.relative_to(ROOT).parts)}
    assert found <= listed, f"packages missing from pyproject.toml: {sorted(found - listed)}"


def test_every_kernel_source_is_shipped():
    """A regular install ships every file the ONNX Runtime kernel library is compiled from (runtime/ort_kernels.py:
    each family's ort_kernel.cc, ort_kernel.h and a family's own header such as kda/ort_recurrence.h): each is
    matched by pyproject.toml's package-data patterns."""
    import fnmatch
    import tomllib

    patterns = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["*"]
    files = [p for p in (ROOT / "custom_ops").rglob("*") if p.suffix in (".cc", ".h")]
    assert any(p.name == "ort_recurrence.h" for p in files)
    missed = [str(p.relative_to(ROOT)) for p in files if not any(fnmatch.fnmatch(p.name, pat) for pat in patterns)]
    assert not missed, f"kernel sources a regular install would not ship (pyproject.toml package-data): {missed}"


def test_nothing_points_outside_the_repository():
    pattern = re.compile(r"\.\./shared|/work/|spec/k3-architecture|export-toolchain\.md|DESIGN\.md")
    files = [p for p in ROOT.rglob("*") if p.suffix in (".py", ".md", ".sh", ".toml") and p.is_file()
             and not {".venv", ".git"} & set(p.relative_to(ROOT).parts)]
    hits = [f"{p.relative_to(ROOT)}:{i}" for p in files for i, line in enumerate(p.read_text().splitlines(), 1)
            if pattern.search(line) and p.name != "test_layout.py"]
    assert not hits, "references outside the repository:\n" + "\n".join(hits)


def test_imports_point_one_way():
    """A module imports only its own package or one below it in PACKAGE_ORDER (function-level and
    TYPE_CHECKING imports count: an import inside a function still runs up)."""
    back = [f"{p.relative_to(ROOT)}:{line}: {mod} (layer {layer(mod)}) -> {target} (layer {layer(target)})"
            for p in sources() for mod, line, target in project_imports(p, ROOT) if layer(target) > layer(mod)]
    order = " < ".join("/".join(n or "k3x" for n in g) for g in PACKAGE_ORDER)
    assert not back, f"imports running back up the package order ({order}):\n" + "\n".join(back)


def test_no_import_cycle_across_packages():
    cycles = package_cycles([edge for p in sources() for edge in project_imports(p, ROOT)])
    assert not cycles, "packages importing each other: " + "; ".join(" <-> ".join(c) for c in cycles)


def test_no_import_circle_between_modules():
    """No two project modules import each other, directly or around a loop, at module top or inside a
    function: what two modules share lives in a third below both (runtime/base.py, folder/schema.py,
    exporter/options.py, custom_ops/<family>/limits.py). A heavy library imported lazily (triton, onnxruntime,
    tensorrt) is not a project module and so never forms a circle."""
    cycles = module_cycles([edge for p in sources() for edge in project_imports(p, ROOT)])
    assert not cycles, "modules importing each other: " + "; ".join(" <-> ".join(c) for c in cycles)


def test_no_private_name_imported_from_another_module():
    """`from x import _name` couples a file to another file's internals: make the name public in its owner
    (or move the code there). Tests are excluded."""
    hits = [f"{p.relative_to(ROOT)}:{line}: {target}.{name}" for p in sources()
            for line, target, name in private_imports(p, ROOT)]
    assert not hits, "private names imported across files:\n" + "\n".join(hits)


def test_the_import_guards_see_a_violation(tmp_path):
    """The scans above can fail: a model module importing the runtime (inside a function) and a private name
    of another module are caught."""
    pkg = tmp_path / "model"
    pkg.mkdir()
    probe = pkg / "probe.py"
    probe.write_text("def f():\n    from ..runtime.runners import _artifact\n")
    edges = project_imports(probe, tmp_path)
    assert [(m, t) for m, _, t in edges] == [("k3x.model.probe", "k3x.runtime.runners")]
    assert layer("k3x.runtime.runners") > layer("k3x.model.probe")
    assert private_imports(probe, tmp_path) == [(2, "k3x.runtime.runners", "_artifact")]
    assert package_cycles([("k3x.model.a", 1, "k3x.runtime.b"), ("k3x.runtime.b", 1, "k3x.model.c")]) == [
        ["model", "runtime"]]
    loop = [("k3x.runtime.a", 1, "k3x.runtime.b"), ("k3x.runtime.b", 3, "k3x.runtime.c"),
            ("k3x.runtime.c", 9, "k3x.runtime.a"), ("k3x.runtime.c", 2, "k3x.folder.d")]
    assert module_cycles(loop) == [["k3x.runtime.a", "k3x.runtime.b", "k3x.runtime.c"]]
    assert package_cycles(loop) == []
