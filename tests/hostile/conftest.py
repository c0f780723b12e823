"""Fixtures of the hostile-input suite: one k3-mini checkpoint and one pt2 + ONNX export per session
(about 20 s on two cores), copied per test so each test may tamper with its own folder."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from hostile_util import k3x


@pytest.fixture(scope="session")
def built(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("hostile")
    code, out = k3x("init-checkpoint", "--preset", "k3-mini", "--out", root / "ckpt")
    assert code == 0, out
    code, out = k3x("export", "--checkpoint", root / "ckpt", "--target", "pt2", "--target", "onnx",
                    "--out", root / "export")
    assert code == 0, out
    return root


@pytest.fixture()
def export_dir(built, tmp_path) -> Path:
    out = tmp_path / "export"
    shutil.copytree(built / "export", out)
    return out


@pytest.fixture()
def ckpt_dir(built, tmp_path) -> Path:
    out = tmp_path / "ckpt"
    shutil.copytree(built / "ckpt", out)
    return out
