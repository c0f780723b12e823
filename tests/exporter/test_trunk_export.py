"""CPU trunks (`k3x export --trunk bf16 | int8`, model/trunk.py) against the fp32 export of the same checkpoint
(tests/trunk_models.py: routing fixed by the router bias): the manifest records the form, the ort flavor alone
is written, the logits stay within the trunk's tolerance (runtime/tolerances.py) and the greedy tokens are the
fp32 export's wherever fp32's top two logits are further apart than that tolerance, `k3x verify` holds the export
to its own model (the same trunk) at fp32's tolerance, and ONNX Runtime runs each with the kernel library and without it (K3X_ORT_KERNELS=0)."""

from __future__ import annotations

import json

import pytest
import torch
from trunk_models import TRUNKS
from typer.testing import CliRunner

from k3x.cli import app
from k3x.model import preset
from k3x.model.trunk import trunk_modules
from k3x.runtime.ort_runner import OrtRunner
from k3x.runtime.runners import next_feeds, start_feeds
from k3x.runtime.tolerances import tol

OPS = {"bf16": "k3::linear_bf16", "int8": "k3::linear_q8"}


def manifest(folder):
    return json.loads((folder / "manifest.json").read_text())


def test_the_manifest_records_the_trunk_and_the_ort_flavor_alone(trunk_exports):
    from k3x.model import build_model

    projections = len(trunk_modules(build_model(preset("k3-mini"), device="meta", seed=None)))
    for trunk in TRUNKS:
        m = manifest(trunk_exports / trunk)
        assert m["options"]["trunk"] == trunk and m["dtype"] == "fp32"
        flavors = set(m["artifacts"]["onnx"]["flavors"])
        assert flavors == ({"ort", "trt"} if trunk == "dense" else {"ort"}), trunk
        for form, op in OPS.items():
            assert m["op_counts"].get(op, 0) == (projections if form == trunk else 0), (trunk, op)


def test_inspect_export_shows_the_trunk(trunk_exports):
    r = CliRunner().invoke(app, ["inspect", "--export", str(trunk_exports / "int8")])
    assert r.exit_code == 0 and r.output.splitlines()[0] == \
        "weights: dtype fp32, trunk int8 (8-bit projection weights per block of 32, fp32 activations), experts mxfp4"


def test_a_serving_export_with_a_trunk_verifies(trunk_exports, tmp_path):
    """`--serving`, ONNX Runtime's CPU deployment: the int8 trunk's serving step against its own model."""
    from k3x.exporter.options import ExportOptions, Target, Trunk
    from k3x.exporter.pipeline import export

    export(ExportOptions((Target.ONNX,), tmp_path / "s", checkpoint=trunk_exports / "ckpt", serving=True,
                         block_size=8, trunk=Trunk.INT8))
    r = CliRunner().invoke(app, ["verify", str(tmp_path / "s")])
    assert r.exit_code == 0 and "(int8 trunk, own model: atol 0.1" in r.output and "PASS" in r.output, r.output


def teacher_forced(runner: OrtRunner, cfg, prompt: torch.Tensor, tokens: list[int]) -> torch.Tensor:
    """Last-position logits of the prefill and of one decode step per token of `tokens` [steps + 1, vocab]."""
    out, logits = runner.infer(start_feeds(cfg, prompt)), []
    for t in tokens:
        logits.append(out["logits"][0, -1])
        out = runner.infer(next_feeds(cfg, out, torch.tensor([[t]])))
    return torch.stack(logits)


# the fp32 top-two margin above which the trunk's greedy token must be fp32's: the largest margin a trunk's
# rounding closed on these prompts is 0.004 (bf16) and 0.185 (int8, whose activations MatMulNBits rounds too)
NEAR_TIE = {"bf16": 0.01, "int8": 0.25}


@pytest.mark.parametrize("trunk", ["bf16", "int8"])
def test_logits_within_the_tolerance_and_greedy_tokens_of_the_fp32_export(trunk_exports, trunk):
    """Teacher-forced on fp32's own greedy continuation (4 prompts of 7, 16 steps each): every logit within the
    trunk's tolerance, and the trunk's greedy token fp32's wherever fp32's top two are NEAR_TIE apart."""
    cfg = preset("k3-mini")
    fp32 = OrtRunner(trunk_exports / "dense" / "model.onnx", provider="cpu")
    form = OrtRunner(trunk_exports / trunk / "model.onnx", provider="cpu")
    t = tol(f"{trunk} trunk")
    kept = total = 0
    for seed in range(4):
        prompt = torch.randint(0, cfg.vocab_size, (1, 7), generator=torch.Generator().manual_seed(seed))
        out, tokens = fp32.infer(start_feeds(cfg, prompt)), []
        for _ in range(16):
            tokens.append(int(out["logits"][0, -1].argmax()))
            out = fp32.infer(next_feeds(cfg, out, torch.tensor([[tokens[-1]]])))
        want, got = teacher_forced(fp32, cfg, prompt, tokens), teacher_forced(form, cfg, prompt, tokens)
        torch.testing.assert_close(got, want, **t)
        top2 = want.topk(2).values
        clear = (top2[:, 0] - top2[:, 1]) > NEAR_TIE[trunk]
        assert torch.equal(got.argmax(-1)[clear], want.argmax(-1)[clear]), (seed, got.argmax(-1), want.argmax(-1))
        kept, total = kept + int(clear.sum()), total + len(clear)
    assert kept >= total // 3, f"only {kept} of {total} tokens had a clear margin: the comparison says little"


@pytest.mark.parametrize("trunk", ["bf16", "int8"])
def test_verify_holds_the_export_to_its_own_model_at_fp32_tolerance(trunk_exports, trunk):
    """The eager reference is the export's own model (the same trunk): a bf16 export is checked as tightly as an
    fp32 export; an int8 one at its own key, which admits one activation code's flip (runtime/tolerances.py); the
    trunk's distance from the fp32 model is the test above's."""
    r = CliRunner().invoke(app, ["verify", str(trunk_exports / trunk)])
    out = r.output
    assert r.exit_code == 0, out
    key = "float32: atol 2e-05" if trunk == "bf16" else "int8 trunk, own model: atol 0.1, rtol 0.02"
    assert f"parity vs eager reference ({key}" in out and "PASS" in out
    assert "state contract: ok" in out


@pytest.mark.parametrize("trunk", ["bf16", "int8"])
def test_ort_runs_it_with_and_without_the_kernel_library(trunk_exports, trunk, kernels, monkeypatch):
    cfg = preset("k3-mini")
    prompt = torch.randint(0, cfg.vocab_size, (1, 9), generator=torch.Generator().manual_seed(5))
    with_lib = OrtRunner(trunk_exports / trunk / "model.onnx", provider="cpu").infer(start_feeds(cfg, prompt))
    monkeypatch.setenv("K3X_ORT_KERNELS", "0")
    body = OrtRunner(trunk_exports / trunk / "model.onnx", provider="cpu").infer(start_feeds(cfg, prompt))
    assert set(with_lib) == set(body)
    for name in body:  # kernels and function bodies compute the same fp32 math on the same weights
        torch.testing.assert_close(with_lib[name], body[name], atol=1e-3, rtol=1e-3, msg=name)
