"""The ONNX Runtime kernel library for the kernel tests (test_ort_kernels*.py), built once per run into a
cache of its own."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def kernels(tmp_path_factory):
    """The library, built into a fresh cache (the rest of the suite never sees it)."""
    mp = pytest.MonkeyPatch()
    mp.setenv("XDG_CACHE_HOME", str(tmp_path_factory.mktemp("cache")))
    mp.delenv("K3X_ORT_KERNELS", raising=False)
    from k3x.runtime.ort_kernels import build, library
    from k3x.runtime.runners import RunnerError

    assert library() is None  # nothing built in a fresh cache
    try:
        path = build()
    except RunnerError as e:  # the headers' mirror out of reach is the network's fault, not the code's
        if "cannot fetch" not in str(e):
            raise
        mp.undo()
        pytest.skip(str(e))
    assert library() == path
    yield path
    mp.undo()
