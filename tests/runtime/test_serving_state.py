"""The state contract on serving exports (issue 21): `k3x verify` on a `--serving` export hands every step the
pools holding the true state and names a backend that decodes from a zeroed, stale (one step earlier) or
transposed KDA state, or returns its rows in the wrong dtype (exit 1); the honest step passes. A sequence's
state handed across processes through `k3x run --save-state / --load-state` on a serving export (its slot's
KDA rows and its latent rows) continues with the tokens and bit-identical logits of one process, on pt2 and
ort. The bugs are injected by a wrapper (tests/state_bugs.py) around the export's real pt2 serving step."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from state_bugs import BUG_LINES, TRANSPOSED_LINE, Corrupts, ReturnsTransposed
from state_split import split
from typer.testing import CliRunner

import k3x.runtime.serving_check as serving_check
from k3x.checkpoint.save import save_checkpoint
from k3x.cli import app
from k3x.folder.artifacts import ExportFolder
from k3x.model import build_model, preset
from k3x.runtime.base import RunnerOptions
from k3x.runtime.serve import serving_runner
from k3x.runtime.state_check import STATE_STEPS, check_state

CFG = preset("k3-mini")
cli = CliRunner()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """The weights `export --preset k3-mini` (the session's serving_export) cuts up, as a checkpoint: the
    eager reference of verify."""
    out = tmp_path_factory.mktemp("ckpt") / "k3-mini"
    save_checkpoint(build_model(CFG, dtype=torch.float32, seed=0).eval(), out, expert_format="dense")
    return out


@pytest.fixture(scope="module")
def pt2(serving_export):
    return serving_runner("pt2", serving_export)


@pytest.fixture(scope="module")
def reference(serving_export, checkpoint):
    """(the eager serving step, its run: a prefill and STATE_STEPS decode steps, the true pools of each), once."""
    folder = ExportFolder.open(serving_export)
    ref = serving_check.serving_reference(folder, RunnerOptions(checkpoint=checkpoint))
    prompt = torch.randint(0, CFG.vocab_size, (7,), generator=torch.Generator().manual_seed(0)).tolist()
    run = serving_check.serving_steps(ref, CFG, prompt, STATE_STEPS, torch.float32, 8)
    return ref, run, folder.state_contract(), prompt


def findings(reference, runner) -> list[str]:
    ref, run, contract, prompt = reference
    return [f.line() for f in check_state(ref, runner, CFG, contract, prompt=torch.tensor([prompt]),
                                          dtype=torch.float32, run=run)]


def verify(serving_export, checkpoint, tmp_path, *args):
    out = tmp_path / "report.json"
    r = cli.invoke(app, ["verify", str(serving_export), "--checkpoint", str(checkpoint), "--steps", "2",
                         "--json", str(out), *args])
    return r, (json.loads(out.read_text()) if out.is_file() else None)


@pytest.mark.parametrize("bug,line", [("", None), *BUG_LINES])
def test_the_serving_state_checks_name_each_state_bug(reference, pt2, bug, line):
    got = findings(reference, Corrupts(pt2, bug) if bug else pt2)
    if not bug:
        assert got == []
    else:
        assert any(g.startswith(line) for g in got), "\n".join(got)


def test_a_step_returning_a_transposed_state_is_named(reference, pt2):
    got = findings(reference, ReturnsTransposed(pt2))
    assert TRANSPOSED_LINE in got, "\n".join(got)


def test_verify_on_a_serving_export_passes_every_backend_and_fails_a_bug(serving_export, checkpoint, pt2,
                                                                          monkeypatch, tmp_path):
    r, report = verify(serving_export, checkpoint, tmp_path)
    assert r.exit_code == 0 and "state contract: ok" in r.output, r.output
    assert report["backends"] == ["pt2", "ort"] and report["ok"] and len(report["steps"]) == 6
    monkeypatch.setattr(serving_check, "serving_runner", lambda b, folder, options: Corrupts(pt2, "zeroed"))
    r, report = verify(serving_export, checkpoint, tmp_path, "--backends", "pt2")
    assert r.exit_code == 1 and "state contract: FAIL" in r.output and not report["state_ok"], r.output
    assert dict(BUG_LINES)["zeroed"] in r.output, r.output


def test_serving_prefill_and_decode_in_two_processes_equal_one_process_bit_for_bit(serving_export, tmp_path):
    one = split("one", serving_export, tmp_path / "unused", tmp_path / "one.safetensors")
    split("save", serving_export, tmp_path / "state", tmp_path / "save.safetensors")
    two = split("load", serving_export, tmp_path / "state", tmp_path / "two.safetensors")
    with safe_open(str(tmp_path / "state.pt2.safetensors"), framework="pt") as f:  # the slot's rows, the latents
        assert list(f.get_tensor("layer.0.kda_recurrent").shape) == [4, 16, 16]
        assert list(f.get_tensor("layer.2.mla_latent").shape) == [7, 32] and f.get_tensor("layer.2.mla_latent").any()
    for backend in ("pt2", "ort"):
        assert one[f"{backend}.tokens"].tolist() == two[f"{backend}.tokens"].tolist() and \
            len(two[f"{backend}.tokens"]) == 6, backend
        assert torch.equal(one[f"{backend}.logits"], two[f"{backend}.logits"]), backend  # bit-identical


def run(folder, *args) -> tuple[int, str]:
    r = cli.invoke(app, ["run", str(folder), "--backend", "pt2", *map(str, args)])
    return r.exit_code, r.output


def test_cli_hands_a_serving_state_across_and_refuses_what_cannot_resume(serving_export, tmp_path):
    state, whole, two = tmp_path / "s.safetensors", tmp_path / "whole.json", tmp_path / "two.json"
    assert run(serving_export, "--prompt-ids", "3,1,4,1,5", "--max-new-tokens", "5", "--json", whole)[0] == 0
    code, out = run(serving_export, "--prompt-ids", "3,1,4,1,5", "--max-new-tokens", "1", "--save-state", state)
    assert code == 0 and state.is_file(), out
    code, out = run(serving_export, "--load-state", state, "--max-new-tokens", "5", "--json", two)
    assert code == 0, out
    assert json.loads(two.read_text())[0]["tokens"] == json.loads(whole.read_text())[0]["tokens"]
    for args, message in [(("--prefix-cache",), "--prefix-cache with --load-state"),
                          (("--prompts", state), "one sequence (--prompt / --prompt-ids), not --prompts")]:
        code, out = run(serving_export, "--load-state", state, *args)
        assert code == 1 and message in out and len(out.strip().splitlines()) == 1, out
