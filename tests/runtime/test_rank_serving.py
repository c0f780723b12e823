"""The serving step on rank programs (`k3x export --serving --tp 2 --ep 2`, k3-mini, fp32, gloo on CPU): each rank's
program takes the packed step inputs and its own pools (KDA rows of its heads; the MLA latent pool whole on every
rank), experts split as rank programs do. Proof: prompts of different lengths (more than the slots, the longest
prefilled in chunks, different token counts) through continuous batching under torchrun give the greedy tokens of
their solo eager runs, logits within the fp32 tolerance; with the prefix cache, with n-gram speculation, with both,
and with a draft export (`--draft`: every rank loads it; ranks 1..3 made to propose other drafts, so only the
agreement on rank 0's drafts keeps them in step), the ranks' tokens equal the single-process serving run's, the
cache hits where it does in one process and drafts are accepted and rejected as there; a sequence prefilled in one
launch (`--save-state`: each rank writes its own file) and decoded in another (`--load-state`) gives the one
launch's tokens and logits bit for bit, and a rank's file is refused by another rank, rank count or plan; `k3x run
--prompts` spawns the ranks itself and prints the same tokens; `k3x inspect --sequences --tp --ep` prints the pools
per rank.

The model is the "echo" k3-mini of tests/runtime/test_speculate.py (it mostly repeats, so n-gram drafts are
sometimes accepted). One export (module scope, pt2 + ONNX), the session's draft export (tests/conftest.py)
and three 4-process launches (pt2 under torchrun: every run in one launch, the decode from the state files
in a second; ort spawned by k3x).
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save
from dist_launch import launch
from serving_cases import assert_records_match, prompts, solo
from typer.testing import CliRunner

from k3x.bench.speculate import echo_model
from k3x.checkpoint.save import save_checkpoint
from k3x.cli import app
from k3x.exporter.options import ExportOptions, Target
from k3x.exporter.pipeline import export
from k3x.folder.artifacts import read_manifest
from k3x.model import preset
from k3x.runtime.state_file import Shard, StateFileError, load_state, shard_path

CFG = preset("k3-mini")
R, S = [1, 2, 3, 4, 5] * 5, [7, 8] * 10  # repetitive: n-gram drafts are found, and the echo model often agrees
PROMPTS = prompts([1, 37, 4, 12, 2], CFG.vocab_size, seed=3) + [R, R + [9, 9, 7], R[:20] + [7, 8] * 3, S, S + [3]]
NEWS, NEW = [3, 1, 4, 2, 3, 8, 6, 7, 9, 5], 3
SERVE = {"max_sequences": 2, "block_size": 8, "max_step_tokens": 16}  # 37 tokens: 3 chunks
RUNS = {"plain": {"serve": SERVE}, "cache": {"serve": {**SERVE, "prefix_cache": True}},
        "ngram": {"serve": SERVE, "speculate": 3}, "both": {"serve": {**SERVE, "prefix_cache": True}, "speculate": 3}}
SPLIT = {"serve": SERVE, "prompts": [PROMPTS[1]], "max_new_tokens": [6]}  # 37 tokens: prefilled in 3 chunks
WORKER = Path(__file__).parent.parent / "rank_serving_worker.py"
cli = CliRunner()


@pytest.fixture(scope="module")
def model():
    return echo_model("k3-mini", 0.5)  # the weights the rank export cuts up


@pytest.fixture(scope="module")
def ranks(tmp_path_factory, model) -> Path:
    root = tmp_path_factory.mktemp("ranks")
    save_checkpoint(model, root / "ckpt", expert_format="dense")
    export(ExportOptions((Target.PT2, Target.ONNX), root / "serve", checkpoint=root / "ckpt", tp=2, ep=2,
                         serving=True, block_size=8))
    return root / "serve"


@pytest.fixture(scope="module")
def served(ranks, draft_export, tmp_path_factory) -> dict[str, list[SimpleNamespace]]:
    """Every run of RUNS and a draft-export run on the pt2 rank programs, in one torchrun launch -> records by
    run name."""
    tmp = tmp_path_factory.mktemp("served")
    draft = {"serve": SERVE, "draft": {"export": str(draft_export), "tokens": 3, "skew": True}}
    prefill = {**SPLIT, "save_state": str(tmp / "state")}  # prefill and decode here, the state saved on the way
    return {**serve_on_ranks(ranks, tmp, {**RUNS, "draft": draft, "prefill": prefill}), "state": tmp / "state"}


@pytest.fixture(scope="module")
def resumed(ranks, served, tmp_path_factory) -> dict[str, list[SimpleNamespace]]:
    """The "prefill" run's sequence decoded from its state files in a second torchrun launch; "tampered": from
    a copy whose rank 1 file's saved logits pick another first token (every rank must take rank 0's)."""
    tmp = tmp_path_factory.mktemp("resumed")
    for r in range(4):
        tensors, meta = read_safetensors(shard_path(served["state"], Shard(r, 4)))
        if r == 1:
            tensors["logits"] = -tensors["logits"]
        (tmp / f"tampered.rank{r}of4").write_bytes(save(tensors, metadata=meta))
    return serve_on_ranks(ranks, tmp, {"decode": {**SPLIT, "load_state": str(served["state"])},
                                       "tampered": {**SPLIT, "load_state": str(tmp / "tampered")}})


def read_safetensors(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    with safe_open(str(path), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, f.metadata()


def serve_on_ranks(ranks: Path, tmp: Path, runs: dict) -> dict[str, list[SimpleNamespace]]:
    """`runs` on the pt2 rank programs in one torchrun launch of the worker -> records by run name, "agree"."""
    (tmp / "spec.json").write_text(json.dumps({"prompts": PROMPTS, "max_new_tokens": NEWS, "backend": "pt2",
                                               "runs": runs}))
    r = launch([str(ranks), str(tmp / "spec.json"), str(tmp / "out.pt")], torchrun=4, script=WORKER)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    out = torch.load(tmp / "out.pt")
    return {"agree": out.pop("agree"), **{name: [SimpleNamespace(**d) for d in rs] for name, rs in out.items()}}


@pytest.fixture(scope="module")
def want(model) -> list[tuple[list[int], list[torch.Tensor]]]:
    """Each prompt's solo eager greedy tokens and logits (one process, one prompt at a time)."""
    return [solo(model, p, n) for p, n in zip(PROMPTS, NEWS)]


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


def test_continuous_batching_on_ranks_equals_solo_eager(served, want):
    assert served["agree"], "the ranks' records differ"
    # the echo model's logits have rms ~8: the fp32 atol is scaled to them (TP sums partials in another order)
    assert_records_match(served["plain"], want, "pt2 ranks tp=2 x ep=2", scaled=True)


def test_prefix_cache_and_speculation_on_ranks_equal_plain_greedy(served, want):
    """Every rank decides alike from the agreed tokens (the worker checks all ranks' records are equal): the
    tokens of plain greedy decoding (logits: packed differently, they differ from the plain run's in the last
    bits), the cache hitting, drafts both accepted and rolled back."""
    for name in ("cache", "ngram", "both"):
        assert [r.tokens for r in served[name]] == [tokens for tokens, _ in want], name
    # R + [9, 9, 7] starts from R's snapshot at 24 (3 blocks), R[:20] + ... and S + [3] from 16 (2 blocks)
    cached = [0] * 5 + [0, 24, 16, 0, 16]
    assert [r.cached for r in served["cache"]] == [r.cached for r in served["both"]] == cached
    assert not any(r.cached for r in served["ngram"]) and not any(r.drafted for r in served["cache"])
    for name in ("ngram", "both"):
        drafted, accepted = sum(r.drafted for r in served[name]), sum(r.accepted for r in served[name])
        assert 0 < accepted < drafted, (name, accepted, drafted)


def test_draft_export_on_ranks_equals_solo_greedy(served, want):
    """Every rank runs the draft export; ranks 1..3 alter their drafts (the worker's `Skewed`) and take rank
    0's (speculate.agree_drafts): the tokens of solo greedy decoding, every rank's records (tokens, drafted,
    accepted) equal, drafts both accepted and rolled back."""
    assert served["agree"], "the ranks' records differ"
    assert [r.tokens for r in served["draft"]] == [tokens for tokens, _ in want]
    drafted, accepted = sum(r.drafted for r in served["draft"]), sum(r.accepted for r in served["draft"])
    assert 0 < accepted < drafted, (accepted, drafted)


def test_state_files_hand_a_sequence_from_one_rank_launch_to_another(served, resumed, want):
    """Prefill in one torchrun launch (each rank writes its pools' rows, FILE.rank{r}of4), decode in another:
    the tokens and logits of the one launch, bit for bit (the first token from the saved logits)."""
    assert sorted(p.name for p in served["state"].parent.glob("state*")) == [f"state.rank{r}of4" for r in range(4)]
    assert resumed["agree"], "the ranks' records differ"
    (one,), (two,) = served["prefill"], resumed["decode"]
    assert two.tokens == one.tokens and len(one.tokens) == 6 and one.tokens[0] == want[1][0][0]
    assert len(two.logits) == 6 and all(torch.equal(a, b) for a, b in zip(one.logits, two.logits))
    assert resumed["tampered"][0].tokens == one.tokens  # rank 1's own first pick differs: rank 0's is taken


def test_a_rank_state_file_is_refused_by_another_rank_plan_or_rank_count(ranks, served, draft_export, tmp_path):
    file = shard_path(served["state"], Shard(0, 4))
    for shard in (Shard(1, 4, "tp=2 ep=2"), Shard(0, 4, "tp=4 ep=1")):  # checked before the contract
        with pytest.raises(StateFileError, match=r"saved by rank 0 of 4 \(tp=2 ep=2\), loaded by rank"):
            load_state(file, {"tensors": []}, "", CFG.vocab_size, shard, origin="", context=64)
    r = cli.invoke(app, ["run", str(draft_export), "--load-state", str(file), "--max-new-tokens", "2"])
    assert r.exit_code == 1 and r.output.strip().count("\n") == 0 and "Traceback" not in r.output, r.output
    assert "saved by rank 0 of 4 (tp=2 ep=2), loaded by rank 0 of 1 (tp=1 ep=1)" in r.output
    (tmp_path / "s.rank0of4").write_bytes(file.read_bytes())  # rank 1..3's files missing: refused before spawning
    r = cli.invoke(app, ["run", str(ranks), "--load-state", str(tmp_path / "s"), "--backend", "pt2"])
    assert r.exit_code == 1 and f"--load-state {tmp_path / 's.rank1of4'}: does not exist (this export runs 4 ranks" \
        in r.output, r.output


@pytest.mark.slow
def test_cli_serves_prompts_on_rank_export_spawning_the_ranks(ranks, model, tmp_path):
    """`k3x run RANKS --prompts FILE` outside a launcher: k3x starts the 4 ranks (default backend ort: the rank
    folders' ONNX); rank 0 prints and writes --json, in input order."""
    ps = prompts([5, 1, 20], CFG.vocab_size, seed=4)
    (tmp_path / "p.jsonl").write_text("".join(json.dumps({"prompt_ids": p}) + "\n" for p in ps))
    out = tmp_path / "out.json"
    r = launch(["run", str(ranks), "--prompts", str(tmp_path / "p.jsonl"), "--max-new-tokens", str(NEW),
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
