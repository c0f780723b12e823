"""bench/gpu_check.py's parity path runs on CPU (`--cpu-selftest`, Triton interpreter) and writes its report."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_gpu_check_cpu_selftest(tmp_path):
    env = {**os.environ, "TRITON_INTERPRET": "1", "OUT": str(tmp_path)}
    proc = subprocess.run([sys.executable, "bench/gpu_check.py", "--cpu-selftest"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    parity = [r for r in report["results"] if r["kind"] == "parity"]
    assert report["failed"] == 0 and report["selftest"], out
    assert {r["name"].split()[0] for r in parity} >= {"kda_chunked", "kda_recurrent_", "attn_res", "moe"}, out
    assert all(r["ok"] for r in parity), out


def test_gpu_check_importable_without_running():
    proc = subprocess.run([sys.executable, "-c", "import sys; sys.path.insert(0, 'bench'); import gpu_check; "
                           "print(len(gpu_check.CHECKS))"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and int(proc.stdout.strip()) >= 7, proc.stdout + proc.stderr
