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

CFG = preset("k3-mini")
KDA_LAYERS = "layers 0, 1, 3"
cli = CliRunner()


class Corrupts:
    """An honest runner behind one state bug: on the state it is given (`zeroed`, `stale`: the KDA state of
    its previous call, `transposed`: recurrent key/value axes swapped, `one-layer`: layer 3 zeroed) or on
    the state it returns (`bf16`: the recurrent state in bf16)."""

    def __init__(self, inner, bug: str) -> None:
        self.inner, self.bug, self.name, self.previous = inner, bug, f"{inner.name}+{bug}", None

    def infer(self, feeds):
        kda = [n for n in feeds if n.endswith((".conv", ".recurrent"))]
        given = feeds
        if self.bug == "zeroed":
            feeds = {**feeds, **{n: torch.zeros_like(feeds[n]) for n in kda}}
        elif self.bug == "one-layer":
            feeds = {**feeds, **{n: torch.zeros_like(feeds[n]) for n in kda if n.startswith("past.3.")}}
        elif self.bug == "stale":
            feeds = {**feeds, **{n: (self.previous or feeds)[n] for n in kda}}
        elif self.bug == "transposed":
            feeds = {**feeds, **{n: feeds[n].transpose(-1, -2).contiguous() for n in kda if n.endswith("recurrent")}}
        self.previous = {n: given[n] for n in kda}
        out = self.inner.infer(feeds)
        if self.bug == "bf16":
            out = {n: v.bfloat16() if n.endswith("recurrent") else v for n, v in out.items()}
        return out


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
    class ReturnsTransposed(Corrupts):
        def infer(self, feeds):
            out = self.inner.infer(feeds)
            return {n: v.transpose(-1, -2) if n.endswith("recurrent") else v for n, v in out.items()}

    got = findings(setup, ReturnsTransposed(setup[1], "returns-transposed"))
    assert "pt2+returns-transposed prefill: layer 1 kda_recurrent: returned a transposed state (axes head, value, " \
           "key; the contract says head, key, value)" in got, "\n".join(got)


@pytest.mark.parametrize("bug,line", [
    ("", "state contract: ok"),
    ("zeroed", f"pt2+zeroed decode 1: logits: decoded from a zeroed KDA state in {KDA_LAYERS},"),
    ("one-layer", "pt2+one-layer decode 1: logits: decoded from a zeroed KDA state in layer 3,"),
    ("stale", f"pt2+stale decode 2: logits: decoded from the KDA state of one step earlier (stale) in {KDA_LAYERS},"),
    ("transposed", "pt2+transposed decode 1: logits: decoded from a transposed KDA recurrent state (key and value "
                   f"axes swapped) in {KDA_LAYERS},"),
    ("bf16", "pt2+bf16 prefill: layer 0 kda_recurrent: dtype bf16, the contract says fp32"),
])
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
