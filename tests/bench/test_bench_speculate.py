"""bench/speculate.py at a tiny size (k3-mini, 2 prompts, 6 new tokens): it exports the echo model, serves it
plain and with n-gram drafts (the bench itself checks the tokens equal), and reports acceptance, speed and
rollback memory in its table and JSON."""

from __future__ import annotations

import json

from k3x.bench import speculate


def test_tiny_run_reports_acceptance_speed_and_memory(tmp_path, capsys):
    r = speculate.main(["--preset", "k3-mini", "--prompts", "2", "--length", "12", "--new", "6", "--repeats", "1",
                        "--tokens", "3", "--json", str(tmp_path / "r.json")])
    assert json.loads((tmp_path / "r.json").read_text()) == r
    assert r["accepted"] > 0 and 0 < r["acceptance"] <= 1 and r["tokens_per_step"] > 1
    assert r["speedup"] > 0 and r["rollback_bytes_per_sequence"] == 0
    assert r["window_bytes_per_sequence"]["k3"] == 3 * 464633856  # K3's KDA state per position, 3 positions
    assert "acceptance" in capsys.readouterr().out


def test_repetitive_prompts_repeat_a_short_pattern():
    ps = speculate.repetitive_prompts(3, 10, 512)
    assert [len(p) for p in ps] == [10, 10, 10]
    assert ps[0][:2] * 5 == ps[0] and ps[1][:3] == ps[1][3:6]
