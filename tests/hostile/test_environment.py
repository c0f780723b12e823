"""`build-engine` works in a fresh shell: TensorRT-RTX's library path is set up by k3x itself (re-exec),
and `--runtime auto` picks a runtime that can build here."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

from k3x.exporter import engine as trt


def test_auto_picks_trt_rtx_without_tensorrt(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "tensorrt" else real(n, *a))
    assert trt.EngineOptions().runtime == "trt-rtx" and trt.resolve_runtime("trt") == "trt"


def test_library_path_outside_the_cli_is_one_clear_error(monkeypatch):
    if importlib.util.find_spec("tensorrt_rtx_libs") is None:
        pytest.skip("TensorRT-RTX not installed")
    monkeypatch.delenv("LD_LIBRARY_PATH", raising=False)
    with pytest.raises(trt.EngineBuildError, match="LD_LIBRARY_PATH to include"):
        trt.ensure_rtx_library_path()


@pytest.mark.trt
@pytest.mark.skipif(importlib.util.find_spec("tensorrt_rtx_bindings") is None, reason="TensorRT-RTX not installed")
def test_build_engine_trt_rtx_in_a_fresh_shell(export_dir):
    env = {k: v for k, v in os.environ.items() if k not in ("LD_LIBRARY_PATH", "K3X_RTX_LIBRARY_PATH_SET")}
    r = subprocess.run([sys.executable, "-c", "from k3x.cli import app; app()", "build-engine", str(export_dir),
                        "--runtime", "trt-rtx", "--sm", "89"], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, (r.returncode, r.stderr[-800:])
    assert (export_dir / "model.engine").stat().st_size > 0


def test_missing_trt_rtx_names_the_pip_extra(monkeypatch):
    import importlib.util

    from k3x.exporter import engine

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "tensorrt_rtx_libs" else real(n, *a))
    for name in ("tensorrt_rtx", "tensorrt_rtx_bindings"):
        monkeypatch.setitem(sys.modules, name, None)  # as if not installed
    with pytest.raises(engine.EngineBuildError) as e:
        engine.import_trt("trt-rtx")
    assert "pip install -e '.[trt-rtx]'" in str(e.value) and "setup_trt_rtx" not in str(e.value)
