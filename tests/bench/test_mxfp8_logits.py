"""bench/mxfp8_logits.py on a tiny run: the same weights under both activation formats (their logits differ, but
not wildly at the op level: E4M3's few-percent rounding), the table and the JSON it writes."""

from __future__ import annotations

import json

from k3x.bench.mxfp8_logits import main


def test_mxfp8_logits_report(tmp_path, capsys):
    out = tmp_path / "r.json"
    (row,) = main(["--preset", "k3-mini", "--prompts", "2", "--length", "4", "--json", str(out)])
    assert json.loads(out.read_text()) == [row]
    assert row["preset"] == "k3-mini" and 0.0 <= row["top1_agreement"] <= 1.0
    assert 0 < row["mean_abs_diff"] <= row["max_abs_diff"]
    assert 0.005 < row["moe_op_rel_err_max"] < 0.2  # E4M3 rounding of both GEMM inputs: a few %
    assert "k3-mini" in capsys.readouterr().out
