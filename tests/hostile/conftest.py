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


@pytest.fixture(scope="module")
def serving_dir(serving_export, built, tmp_path_factory) -> Path:
    """The session's k3-mini serving export (pt2 + ONNX, block size 8) with the CLI export's tokenizer beside
    it (recorded in its manifest), copied once per module: text prompts can be served, and a test may write
    into it."""
    from k3x.folder.artifacts import read_manifest, update_manifest

    out = tmp_path_factory.mktemp("serving") / "export"
    shutil.copytree(serving_export, out)
    names = [f["path"] for f in read_manifest(built / "export")["artifacts"]["tokenizer"]["files"]]
    for name in names:
        shutil.copy(built / "export" / name, out / name)
    update_manifest(out, "tokenizer", [out / n for n in names])
    return out
