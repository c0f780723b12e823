"""The state contract catches real bugs (issue 21): a runner that decodes from a zeroed, stale (one step
earlier) or transposed KDA state, or returns its state in the wrong dtype, is reported by `k3x verify` with
exit 1, naming the layer and what is wrong; the honest runner passes. The bugs are injected by a wrapper
around the real pt2 runner of a k3-mini export."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

import k3x.runtime.runners as runners
from k3x.checkpoint.files import load_checkpoint
from k3x.cli import app
from k3x.folder.artifacts import ExportFolder
from k3x.model import preset
from k3x.runtime.runners import ModuleRunner, make_runner
from k3x.runtime.state_check import check_state
from onnx_mini_folder import mini_export
from state_bugs import BUG_LINES, TRANSPOSED_LINE, Corrupts, ReturnsTransposed

CFG = preset("k3-mini")
cli = CliRunner()


@pytest.fixture(scope="module")
def setup():
    m = mini_export()
    reference = ModuleRunner("eager", load_checkpoint(m.checkpoint), CFG)
    folder = ExportFolder.open(m.folder)
    return reference, make_runner("pt2", folder), folder.state_contract()


def findings(setup, runner):
    reference, _, contract = setup
    prompt = torch.randint(0, CFG.vocab_size, (1, 7), generator=torch.Generator().manual_seed(0))
    return [f.line() for f in check_state(reference, runner, CFG, contract, prompt=prompt, dtype=torch.float32)]


def test_the_honest_runner_keeps_the_contract(setup):
    assert findings(setup, setup[1]) == []


def test_a_runner_returning_a_transposed_state_is_named(setup):
    got = findings(setup, ReturnsTransposed(setup[1]))
    assert TRANSPOSED_LINE in got, "\n".join(got)


@pytest.mark.parametrize("bug,line", [("", "state contract: ok"), *BUG_LINES])
def test_verify_names_each_state_bug_and_exits_1(setup, monkeypatch, tmp_path, bug, line):
    pt2 = setup[1]  # the export's pt2 runner, loaded once for the module
    monkeypatch.setitem(runners.RUNNERS, "pt2", lambda folder, options: Corrupts(pt2, bug) if bug else pt2)
    out = tmp_path / "report.json"
    r = cli.invoke(app, ["verify", str(mini_export().folder), "--backends", "pt2", "--steps", "2", "--json", str(out)])
    assert line in r.output, r.output
    report = json.loads(out.read_text())
    assert (r.exit_code, report["state_ok"]) == ((0, True) if not bug else (1, False)), r.output
    if bug:
        assert "state contract: FAIL" in r.output and report["state_findings"]
