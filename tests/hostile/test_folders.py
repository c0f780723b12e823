"""Whole exports, nothing of the user's lost: foreign folders refused, re-export replaces whole,
concurrent exports refused, killed-export leftovers swept, a full disk is one line with nothing partial,
main_job.sh deletes nothing it did not create, files readable by others."""

from __future__ import annotations

import errno
import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from hostile_util import k3x

from k3x.exporter import pipeline as export_mod
from k3x.folder import staging
from k3x.folder.artifacts import ExportFolder

ROOT = Path(__file__).resolve().parents[2]
FAST = ("--preset", "k3-mini", "--no-weights", "--target", "pt2")


def quick_export(out: Path):
    return k3x("export", *FAST, "--out", out)


def siblings(out: Path) -> list[str]:
    return sorted(p.name for p in out.parent.iterdir() if p.name.startswith(f".{out.name}."))


def test_export_into_a_foreign_folder_is_refused(tmp_path):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "model.onnx").write_text("my own file")
    (out / "notes.txt").write_text("keep me")
    code, text = quick_export(out)
    assert code == 1 and "not a k3x export folder" in text, text
    assert (out / "model.onnx").read_text() == "my own file" and sorted(os.listdir(out)) == ["model.onnx", "notes.txt"]


def test_reexport_replaces_the_export_whole(export_dir):
    assert (export_dir / "model.onnx").is_file()
    code, text = quick_export(export_dir)
    assert code == 0, text
    m = ExportFolder.open(export_dir)
    assert set(m.manifest["artifacts"]) == {"pt2"} and m.manifest["weights"] is False
    assert sorted(os.listdir(export_dir)) == ["manifest.json", "model.pt2"]  # no stale ONNX
    assert siblings(export_dir) == []
    mode = export_dir.stat().st_mode
    assert mode & stat.S_IROTH and mode & stat.S_IXOTH
    assert all(p.stat().st_mode & stat.S_IROTH for p in export_dir.iterdir())


def test_a_failing_stage_leaves_the_old_export_and_no_leftovers(export_dir, monkeypatch):
    before = {p.name: p.read_bytes() for p in export_dir.iterdir()}

    def boom(ep, ctx):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setitem(export_mod.STAGES, "pt2", boom)
    code, text = quick_export(export_dir)
    errors = [line for line in text.splitlines() if line.startswith("error")]
    assert code == 1 and errors == [f"error: export to {export_dir} failed: no space left on device; nothing was written"]
    assert {p.name: p.read_bytes() for p in export_dir.iterdir()} == before
    assert siblings(export_dir) == []


def test_a_full_disk_in_the_pt2_write_is_an_oserror_not_an_abort(tmp_path):
    code = ("import torch\nfrom k3x.exporter.trace import save_pt2\n"
            "class M(torch.nn.Module):\n  def __init__(s): super().__init__(); s.l = torch.nn.Linear(64, 64)\n"
            "  def forward(s, x): return s.l(x)\n"
            "ep = torch.export.export(M(), (torch.ones(1, 64),))\n"
            "try:\n  save_pt2(ep, '/dev/full')\nexcept OSError as e:\n  print('OSError', e.errno)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": os.environ.get("PYTHONPATH", "")})
    assert r.returncode == 0 and f"OSError {errno.ENOSPC}" in r.stdout, (r.returncode, r.stderr[-400:])


def test_leftovers_of_a_killed_export_are_swept(export_dir):
    tmp = export_dir.parent / f".{export_dir.name}.k3x-tmp-dead"
    tmp.mkdir()
    (tmp / "model.pt2").write_bytes(b"half")
    old = export_dir.parent / f".{export_dir.name}.k3x-old-dead"
    old.mkdir()
    (export_dir.parent / f".{export_dir.name}.k3x-lock").write_text("")  # left by a killed holder: not held
    code, text = quick_export(export_dir)
    assert code == 0, text
    assert siblings(export_dir) == []


def test_a_killed_export_leaves_the_destination_as_it_was(export_dir):
    before = sorted(os.listdir(export_dir))
    script = ("import os, signal\nfrom k3x.exporter import pipeline as e\n"
              "def die(ep, ctx): os.kill(os.getpid(), signal.SIGKILL)\n"
              "e.STAGES['pt2'] = die\n"
              "from k3x.cli import app\n"
              f"app(['export', '--preset', 'k3-mini', '--no-weights', '--target', 'pt2', '--out', {str(export_dir)!r}])\n")
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=300)
    assert r.returncode == -9
    assert sorted(os.listdir(export_dir)) == before and ExportFolder.open(export_dir).verify() == []
    assert any(".k3x-tmp-" in n for n in siblings(export_dir))  # what the next export sweeps
    code, text = quick_export(export_dir)
    assert code == 0 and siblings(export_dir) == [], text


def test_concurrent_export_into_one_folder_is_refused(export_dir):
    before = json.loads((export_dir / "manifest.json").read_text())
    with staging.folder_lock(export_dir):
        code, text = quick_export(export_dir)
    assert code == 1 and "another k3x export or engine build is writing this folder" in text, text
    assert json.loads((export_dir / "manifest.json").read_text()) == before


def test_engine_build_takes_the_folder_lock_and_sweeps_a_killed_build(export_dir, monkeypatch):
    """build-engine holds the same lock as export (refused while another writer holds it, nothing touched)
    and removes the staging folder a killed build left inside the export."""
    from k3x.exporter import engine

    leftover = export_dir / ".tmp-trt-killed"
    leftover.mkdir()
    (leftover / "model.engine").write_bytes(b"half")
    with staging.folder_lock(export_dir):
        with pytest.raises(staging.FolderError, match="engine build is writing this folder"):
            engine.build_engine(export_dir)
        code, text = k3x("build-engine", export_dir, "--runtime", "trt-rtx")  # the CLI: one line, exit 1
        assert code == 1 and "engine build is writing this folder" in text and "Traceback" not in text, text
    assert leftover.is_dir()  # refused before touching anything
    seen = {}
    monkeypatch.setattr(engine, "_build_engine", lambda d, o: seen.setdefault("leftover", leftover.exists()))
    engine.build_engine(export_dir)
    assert seen == {"leftover": False} and not leftover.exists()


def test_main_job_never_deletes_a_users_folder(tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    (work / "thesis.tex").write_text("years of work")
    r = subprocess.run(["bash", str(ROOT / "scripts" / "main_job.sh"), str(work)], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 2 and "not created by scripts/main_job.sh" in r.stderr
    assert (work / "thesis.tex").read_text() == "years of work"
