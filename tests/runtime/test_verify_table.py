"""`k3x verify`'s table lines up whatever the backends are called."""

from __future__ import annotations

import torch


def test_the_table_sizes_its_columns_to_long_backend_names():
    from k3x.runtime.verify import OutputError, StepReport, VerifyReport

    long = "ort-cuda-graph-experimental"
    report = VerifyReport(torch.float32, [StepReport(b, 0, 0.1, [OutputError("logits", 1e-6, 1e-6, True)])
                                          for b in ("pt2", long)])
    lines = report.table().splitlines()
    header, rows = lines[1], lines[2:-1]
    assert {row.index("prefill") for row in rows} == {header.index("step")}, "\n".join(lines)  # columns line up
    assert rows[1].startswith(long + " ")
