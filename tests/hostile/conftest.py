"""Fixtures of the hostile-input suite: one k3-mini checkpoint and one pt2 + ONNX export per session
(about 20 s on two cores), copied per test so each test may tamper with its own folder."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from k3x.cli import app
from k3x.exporter.artifacts import MANIFEST, sha256

cli = CliRunner()


def k3x(*args: str):
    """Run the CLI in-process; (exit code, stdout + stderr)."""
    r = cli.invoke(app, [str(a) for a in args])
    crash = "" if r.exception is None or isinstance(r.exception, SystemExit) else f"\nCRASH {r.exception!r}"
    return r.exit_code, r.output + crash


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


def edit_manifest(folder: Path, change) -> dict:
    """Apply `change(manifest)` (in place) and write it back as the attacker would."""
    m = json.loads((folder / MANIFEST).read_text())
    change(m)
    (folder / MANIFEST).write_text(json.dumps(m))
    return m


def rehash(folder: Path, artifact: str) -> None:
    """Record the current bytes of an artifact's files in the manifest (an attacker controls both)."""
    def change(m):
        for f in m["artifacts"][artifact]["files"]:
            p = folder / f["path"]
            f["bytes"], f["sha256"] = p.stat().st_size, sha256(p)
    edit_manifest(folder, change)
