"""The serving step on rank programs (`k3x export --serving --tp 2 --ep 2`, k3-mini, fp32, gloo on CPU): each
rank's program takes the packed step inputs and its own pools (KDA rows of its heads; the MLA latent pool
whole on every rank), experts split as rank programs do. Proof: prompts of different lengths (more than the
slots, the longest prefilled in chunks, different token counts) through continuous batching under torchrun give the greedy tokens of
their solo eager runs, logits within the fp32 tolerance; `k3x run --prompts` spawns the ranks itself and
prints the same tokens; `k3x inspect --sequences --tp --ep` prints the pools per rank.

One export (module scope, pt2 + ONNX) and two 4-process launches (pt2 under torchrun, ort spawned by k3x).
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from dist_launch import launch
from serving_cases import assert_records_match_solo, prompts, solo
from typer.testing import CliRunner

from k3x.cli import app
from k3x.export.options import ExportOptions, Target
from k3x.export.pipeline import export
from k3x.folder.artifacts import read_manifest
from k3x.model import build_model, preset

CFG = preset("k3-mini")
LENGTHS, NEWS, NEW = [1, 37, 4, 12, 2], [3, 1, 4, 2, 3], 3
SERVE = {"max_sequences": 2, "block_size": 8, "max_step_tokens": 16}  # 37 tokens: 3 chunks
WORKER = Path(__file__).parent.parent / "rank_serving_worker.py"
cli = CliRunner()


@pytest.fixture(scope="module")
def model():
    return build_model(CFG, dtype=torch.float32, seed=0).eval()  # the weights export --preset k3-mini cuts up


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("ranks") / "serve"
    export(ExportOptions((Target.PT2, Target.ONNX), out, preset="k3-mini", tp=2, ep=2, serving=True, block_size=8))
    return out


def test_each_rank_manifest_records_its_serving_step_and_pools(ranks):
    top = read_manifest(ranks)
    assert top["serving"]["pool_split"] == {"conv": "heads over tp", "recurrent": "heads over tp",
                                            "latent": "replicated"}
    assert top["serving"]["pools"]["pool.0.recurrent"] == ["slots", 4, 16, 16]  # the whole model's
    assert top["op_counts"]["k3::kda_packed"] == 3 and top["op_counts"]["k3::mla_paged"] == 3
    for r in top["parallel"]["ranks"]:
        m = read_manifest(ranks / r["dir"])
        pools = m["serving"]["pools"]
        assert pools["pool.0.conv"] == ["slots", 96, 3] and pools["pool.0.recurrent"] == ["slots", 2, 16, 16]
        assert pools["pool.2.latent"] == ["blocks", 8, 32]  # kv_lora 24 + rope 8: not split
        assert m["serving"]["inputs"] == top["serving"]["inputs"] and m["io"] == top["io"]


def test_continuous_batching_on_ranks_equals_solo_eager(ranks, model, tmp_path):
    ps = prompts(LENGTHS, CFG.vocab_size, seed=3)
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"prompts": ps, "max_new_tokens": NEWS, "backend": "pt2", "serve": SERVE}))
    r = launch([str(ranks), str(spec), str(tmp_path / "out.pt")], torchrun=4, script=WORKER)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    records = [SimpleNamespace(**d) for d in torch.load(tmp_path / "out.pt")]  # index, tokens, logits
    assert_records_match_solo(model, records, ps, NEWS, "pt2 ranks tp=2 x ep=2")


@pytest.mark.slow
def test_cli_serves_prompts_on_rank_export_spawning_the_ranks(ranks, model, tmp_path):
    """`k3x run RANKS --prompts FILE` outside a launcher: k3x starts the 4 ranks (default backend ort: the rank
    folders' ONNX); rank 0 prints and writes --json, in input order."""
    ps = prompts([5, 1, 20], CFG.vocab_size, seed=4)
    (tmp_path / "p.txt").write_text("".join(",".join(map(str, p)) + "\n" for p in ps))
    out = tmp_path / "out.json"
    r = launch(["run", str(ranks), "--prompts", str(tmp_path / "p.txt"), "--max-new-tokens", str(NEW),
                "--max-sequences", "2", "--max-step-tokens", "8", "--json", str(out)], torchrun=None)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    want = [solo(model, p, NEW)[0] for p in ps]
    assert [rec["tokens"] for rec in json.loads(out.read_text())] == want
    assert r.stdout.count("[0] tokens: ") == 1 and "served on 4 ranks, tp=2 ep=2, ort" in r.stdout, r.stdout


def test_inspect_prints_pools_per_rank():
    r = cli.invoke(app, ["inspect", "--preset", "k3", "--context", "1048576", "--sequences", "2", "--tp", "2",
                         "--ep", "2"])
    assert r.exit_code == 0, r.output
    whole = cli.invoke(app, ["inspect", "--preset", "k3", "--context", "1048576", "--sequences", "2"]).output
    assert "464,633,856 B per sequence ->" in whole  # 69 KDA layers, 96 heads
    assert "232,316,928 B per sequence per rank" in r.output  # 48 heads per rank
    assert "27,648 B per token per rank, 131,072 blocks" in r.output  # the latent replicated
    assert "on each of 4 ranks (tp=2, ep=2" in r.output


def test_inspect_refuses_a_plan_that_does_not_split():
    r = cli.invoke(app, ["inspect", "--preset", "k3", "--context", "64", "--sequences", "1", "--tp", "5"])
    assert r.exit_code == 1 and "kda.num_heads=96: not divisible by tp=5" in r.output and "Traceback" not in r.output
