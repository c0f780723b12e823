"""bench/gpu_check_tune.py (the `tune` section): a run cut by its budget leaves a table marked incomplete and
says how to resume; `--tune-from` resumes it (measured classes and parity verdicts kept, the rest measured);
the finished table is one the dispatcher reads, and it picks each class's fastest passing candidate. The
whole section's flow (every op's candidates checked and timed) runs in tests/bench/test_gpu_check_script.py's
CPU self-test."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from k3x.custom_ops.kda import candidates as kda
from k3x.plan.dispatch import Candidate, Dispatcher, read_table

ROOT = Path(__file__).resolve().parents[2]


def _tune(out: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "bench/gpu_check.py", "--cpu-selftest", "--only", "tune", *extra],
                          cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "TRITON_INTERPRET": "1", "OUT": str(out)})


def test_cut_run_resumes_and_the_dispatcher_reads_the_table(tmp_path):
    cut = _tune(tmp_path / "a", "--budget", "9")  # under the 10 s a step needs: stops before the first parity
    table_a = json.loads((tmp_path / "a" / "tuned" / "cpu.json").read_text())
    assert cut.returncode == 0 and not table_a["complete"], cut.stdout + cut.stderr
    assert "rerun with --only tune --tune-from" in cut.stdout
    assert not table_a.get("ops") and not any(table_a.get("parity", {}).values())

    # as if the cut run had measured both KDA ops: they must be kept, not redone
    done = {"order": ["k3x"], "ms": {"k3x": 1.0}, "shape": "resumed", "timing": {}}
    table_a["ops"] = {"kda.prefill": {"fp32-tokens<=1024": done}, "kda.decode": {"fp32-rows<=1": done,
                                                                                 "fp32-rows<=8": done}}
    table_a["parity"] = {f"{op}@{shape}": {c.name: {"ok": True} for c in kda.CANDIDATES[op]}
                         for op, shape in ((kda.PREFILL, "T70"), (kda.DECODE, "B3"))}
    partial = tmp_path / "partial.json"
    partial.write_text(json.dumps(table_a))
    proc = _tune(tmp_path / "b", "--tune-from", str(partial))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    table = read_table(tmp_path / "b" / "tuned" / "cpu.json")
    assert table["complete"] and table["ops"]["kda.prefill"]["fp32-tokens<=1024"] == done, out
    assert "resumed: ['k3x']" in out and "tune parity kda." not in out, out  # neither re-checked nor re-timed
    moe = table["ops"]["moe.experts"]["fp32-tokens<=16"]
    assert sorted(moe["order"]) == ["grouped_mm", "k3x"] and table["parity"]["moe.experts@N9"]["grouped_mm"]["ok"]
    assert moe["order"] == sorted(moe["ms"], key=moe["ms"].get)

    d = Dispatcher(tmp_path / "b" / "tuned", lambda: "cpu")
    cands = [Candidate(n, lambda: None) for n in ("k3x", "grouped_mm")]
    assert d.pick("moe.experts", "fp32-tokens<=16", cands, ("k3x",)).name == moe["order"][0]
    assert d.picks()[0].reason == "table cpu"


def test_a_table_of_another_gpu_is_refused(tmp_path):
    other = tmp_path / "H100.json"
    other.write_text(json.dumps({"format": 1, "kind": "H100", "ops": {}}))
    proc = _tune(tmp_path, "--tune-from", str(other))
    assert proc.returncode == 1 and "--tune-from holds a H100 table, this is cpu" in proc.stdout, proc.stdout


def test_only_a_cut_table_left_in_out_is_resumed(tmp_path):
    """A process restarted after a device fault finds its predecessor's cut table in $OUT and goes on from it; a
    finished table there (a previous run's) is replaced; --tune-from is always read."""
    from types import SimpleNamespace

    sys.path.insert(0, str(ROOT / "bench"))
    import gpu_check_tune

    path = tmp_path / "cpu.json"
    ctx = SimpleNamespace(tune_from=None)
    assert gpu_check_tune.load(ctx, path) == {}
    path.write_text(json.dumps({"complete": False, "ops": {"op": {}}}))
    assert gpu_check_tune.load(ctx, path)["ops"] == {"op": {}}
    path.write_text(json.dumps({"complete": True, "ops": {"op": {}}}))
    assert gpu_check_tune.load(ctx, path) == {}
    assert gpu_check_tune.load(SimpleNamespace(tune_from=path), tmp_path / "absent.json")["complete"] is True
