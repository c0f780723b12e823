"""Small CLI things: `verify` checks every backend the export has, `-v` after the command, progress with
elapsed time during long stages."""

from __future__ import annotations

import subprocess
import sys
import time

from hostile_util import k3x

from k3x.cli import hoist_global_flags
from k3x.console import Progress


def test_verify_defaults_to_every_backend_of_the_export(export_dir):
    code, out = k3x("verify", export_dir, "--steps", "1")
    rows = {line.split()[0] for line in out.splitlines() if line.split() and line.split()[0] in ("pt2", "ort")}
    assert code == 0 and rows == {"pt2", "ort"}, out


def test_verbose_flag_after_the_command():
    assert hoist_global_flags(["inspect", "--preset", "k3-mini", "-v"]) == ["-v", "inspect", "--preset", "k3-mini"]
    r = subprocess.run([sys.executable, "-c", "from k3x.cli import app; app()", "inspect", "--preset", "k3-mini", "-v"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "k3-mini" in r.stdout, r.stderr[-500:]


def test_long_stage_prints_elapsed_time(capsys, monkeypatch):
    monkeypatch.setattr(Progress, "TICK_S", 0.05)
    with Progress() as progress:
        progress("trace", None)
        time.sleep(0.3)
        progress("trace", 0.3)
    out = capsys.readouterr().out
    assert "[trace] ..." in out and "[trace] still running, 0 s" in out and out.rstrip().endswith("done in 0.3 s")
