"""Fixtures of the hostile-input suite: the session's k3-mini checkpoint and pt2 + ONNX export
(tests/conftest.py `mini_cli_export`, about 20 s on two cores, shared with other test folders), copied per
test so each test may tamper with its own folder."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def built(mini_cli_export) -> Path:
    """The folder holding `ckpt/` and `export/` (read only: tests copy them, or export from `ckpt`)."""
    root = mini_cli_export.export.parent
    assert mini_cli_export.checkpoint == root / "ckpt"
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
