"""Test-wide fixtures: a fixed seed per test, NaN-poisoned uninitialised memory, and the k3-mini
checkpoint and CLI export that several test folders read (built once per run, whatever the number of xdist
workers: `mini_cli_export`), and the k3-mini serving export the serving tests share (`serving_export`).
How tests are spread over the xdist workers: tests/xdist_support.py.

`torch.empty`, `torch.empty_like` and `Tensor.new_empty` return NaN-filled floating tensors during
tests, so code that reads memory it never wrote fails loudly instead of passing by luck (FLA conftest).
Fake/meta tensors and traced code are left alone so graphs do not gain fill nodes.
"""

from __future__ import annotations

import functools
import os
import random
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))  # `from tolerances import ...` in every test folder

from xdist_support import build_once, share_cores, slow_first  # noqa: E402


def pytest_configure(config):
    share_cores(config)


@pytest.hookimpl(tryfirst=True)  # before xdist sends the collection to the scheduler
def pytest_unconfigure(config):
    """The process-lifetime scratch folders (tests/scratch_dirs.py) go when this process's tests are done."""
    from scratch_dirs import remove_all

    remove_all()


def pytest_collection_modifyitems(config, items):
    slow_first(config, items)


def _poisoned(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        t = fn(*args, **kwargs)
        if (t.is_floating_point() and t.device.type != "meta" and not torch.compiler.is_compiling()
                and not isinstance(t, torch._subclasses.FakeTensor)
                and not torch._C._dispatch_tls_local_include_set().has(torch._C.DispatchKey.Python)):
            with torch.no_grad():
                t.fill_(float("nan"))
        return t

    return wrapper


# torch.device(...) contexts recognise factory functions by identity and cache the set on first use:
# build that cache from the real functions before any test patches them.
import torch.utils._device  # noqa: E402

torch.utils._device._device_constructors()

_REAL = {"empty": torch.empty, "empty_like": torch.empty_like, "new_empty": torch.Tensor.new_empty}


@pytest.fixture(autouse=True)
def _poison_uninitialised_memory(monkeypatch):
    if os.environ.get("K3X_NO_POISON") == "1":
        yield
        return
    monkeypatch.setattr(torch, "empty", _poisoned(_REAL["empty"]))
    monkeypatch.setattr(torch, "empty_like", _poisoned(_REAL["empty_like"]))
    monkeypatch.setattr(torch.Tensor, "new_empty", _poisoned(_REAL["new_empty"]))
    yield


@pytest.fixture(autouse=True, scope="module")
def _torch_threads_per_file():
    """A test file that sets torch's thread count (a bench's `open_serving`, `main`) leaves the next file on its
    worker the worker's share (xdist_support.share_cores), whatever order the files run in."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.fixture(autouse=True)
def _seed():
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
    yield


@pytest.fixture(scope="session")
def draft_export(request) -> Path:
    """A small draft model for speculation (tests/runtime/test_speculate.py, test_rank_serving.py): an "echo"
    k3-mini (bench/speculate.py; seed 1, block outputs scaled by 0.7) exported with --serving, block size 4, ONNX."""
    from k3x.bench.speculate import export_echo

    def build(root: Path) -> None:
        export_echo("k3-mini", 0.7, root, seed=1, block_size=4)  # writes root/ckpt and root/export

    return build_once(request, "draft", build) / "export"


@dataclass(frozen=True)
class CliExport:
    checkpoint: Path  # `k3x init-checkpoint --preset k3-mini` (seed 0, with a tokenizer)
    export: Path  # `k3x export --checkpoint <it> --target pt2 --target onnx` (+ genai, tokenizer)
    output: str  # what that export printed


@pytest.fixture(scope="session")
def mini_cli_export(request) -> CliExport:
    """One k3-mini checkpoint and its pt2 + ONNX export, made through the CLI as a user would, shared by
    every test that only reads them (tests that change files copy them first: tests/hostile/conftest.py)."""
    from typer.testing import CliRunner

    from k3x.cli import app

    def build(root: Path) -> None:
        cli = CliRunner()
        r = cli.invoke(app, ["init-checkpoint", "--preset", "k3-mini", "--out", str(root / "ckpt")])
        assert r.exit_code == 0, r.output
        r = cli.invoke(app, ["export", "--checkpoint", str(root / "ckpt"), "--target", "pt2", "--target", "onnx",
                             "--out", str(root / "export")])
        assert r.exit_code == 0, r.output
        (root / "export-output.txt").write_text(r.output)

    root = build_once(request, "mini-cli", build)
    return CliExport(root / "ckpt", root / "export", (root / "export-output.txt").read_text())


@pytest.fixture(scope="session")
def serving_export(request) -> Path:
    """k3-mini (random weights, seed 0) exported with --serving, block size 8, pt2 + onnx."""
    from k3x.exporter.options import ExportOptions, Target
    from k3x.exporter.pipeline import export

    def build(root: Path) -> None:
        export(ExportOptions((Target.PT2, Target.ONNX), root / "k3-mini", preset="k3-mini", serving=True,
                             block_size=8))

    return build_once(request, "serving", build) / "k3-mini"


@pytest.fixture(scope="session")
def trunk_exports(request) -> Path:
    """A k3-mini checkpoint with fixed routing (`ckpt`) exported to ONNX with each CPU trunk (`dense`, `bf16`,
    `int8`): tests/trunk_models.py."""
    from trunk_models import build_trunk_exports

    return build_once(request, "trunks", build_trunk_exports)


@pytest.fixture(scope="session")
def kernels_cache(tmp_path_factory) -> Path:
    """A cache folder holding the ONNX Runtime kernel library (runtime/ort_kernels.py), built once per worker into
    a fresh cache. Only the tests that ask for `kernels` see it: the rest of the suite runs the function bodies
    (unless the user's own cache holds a build of these sources), whatever ran before them on their worker."""
    cache = tmp_path_factory.mktemp("cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("XDG_CACHE_HOME", str(cache))
        mp.delenv("K3X_ORT_KERNELS", raising=False)
        from k3x.runtime.ort_kernels import build, library
        from ort_kernel_models import skip_without_ort_headers

        assert library() is None  # nothing built in a fresh cache
        skip_without_ort_headers()
        build()
    return cache


@pytest.fixture
def kernels(kernels_cache, monkeypatch) -> Path:
    """The kernel library's path, its cache in effect for this test only (XDG_CACHE_HOME)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(kernels_cache))
    monkeypatch.delenv("K3X_ORT_KERNELS", raising=False)
    from k3x.runtime.ort_kernels import library

    path = library()
    assert path is not None
    return path
