"""Test-wide fixtures: a fixed seed per test, and NaN-poisoned uninitialised memory.

`torch.empty`, `torch.empty_like` and `Tensor.new_empty` return NaN-filled floating tensors during
tests, so code that reads memory it never wrote fails loudly instead of passing by luck (FLA conftest).
Fake/meta tensors and traced code are left alone so graphs do not gain fill nodes.
"""

from __future__ import annotations

import functools
import os
import random
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))  # `from tolerances import ...` in every test folder


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


@pytest.fixture(autouse=True)
def _seed():
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
    yield
