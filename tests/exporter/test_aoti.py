"""AOTInductor: `k3x export --target aoti` compiles k3-mini on CPU; the package matches eager for a prefill
(past_seq = 0) and a decode step. Slow (~1 min: a C++ compile) but part of CI."""

from __future__ import annotations

import pytest
import torch
from typer.testing import CliRunner

from k3x.cli import app
from k3x.exporter.aoti import REQUIRES, compile_aoti, load_aoti
from k3x.folder.artifacts import ExportFolder
from k3x.model import build_model, empty_state, preset
from tolerances import assert_close


@pytest.mark.slow
def test_aoti_package_matches_eager(tmp_path):
    out = tmp_path / "out"
    r = CliRunner().invoke(app, ["export", "--preset", "k3-mini", "--target", "aoti", "--out", str(out)])
    assert r.exit_code == 0, r.output
    assert "[aoti] done in" in r.output and "k3x imported" in r.output  # the runtime requirement is stated
    d = ExportFolder.open(out)
    assert d.manifest["artifacts"]["aoti"]["requires"] == REQUIRES and d.verify() == []

    model = build_model(preset("k3-mini"), seed=0)
    runner = load_aoti(d.artifact("aoti"))
    ids, step = torch.randint(0, 512, (2, 5)), torch.randint(0, 512, (2, 1))
    past = empty_state(model.cfg, 2)
    with torch.no_grad():
        want, want_present = model(ids, past)
        want2, _ = model(step, want_present)
    got, present = runner(ids, past)
    got2, _ = runner(step, present)
    assert_close(got, want, what="aoti prefill logits")
    assert_close(got2, want2, what="aoti decode logits")


def test_aoti_refuses_a_weightless_program(tmp_path):
    with torch.device("meta"):
        model = torch.nn.Linear(4, 4)
    ep = torch.export.export(model, (torch.zeros(2, 4, device="meta"),))
    with pytest.raises(ValueError, match="meta device"):
        compile_aoti(ep, tmp_path / "x.pt2")
