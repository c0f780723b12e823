"""Prefix caching on exported serving steps (pt2 and ONNX Runtime, k3-mini, fp32, block size 8): 12 prompts
sharing prefixes of different lengths give the same greedy tokens (and logits within the fp32 tolerance) with
the cache as without it, compute exactly the prompt tokens the cache cannot supply, and stay equal when a
small budget evicts snapshots. Also `k3x run --prefix-cache` (its summary line and `cached_tokens`)."""

from __future__ import annotations

import json

import pytest
import torch
from serving_cases import prompts
from tolerances import assert_close
from typer.testing import CliRunner

from k3x.cli import app
from k3x.model import preset
from k3x.runtime.serve import ServeOptions, serve, serving_runner
from k3x.text.sampling import SamplingOptions

CFG = preset("k3-mini")
A, B, X, Y, Z, W, V, R = prompts([100, 30, 7, 20, 50, 12, 30, 17], CFG.vocab_size, seed=5)
PROMPTS = [
    A[:5],  # 0: shorter than a block: nothing to cache
    A[:5],  # 1: identical to 0, still no full block below its length
    A[:40] + X,  # 2: first with A[:40]: its chunk ends at 40 (the last boundary below 47), snapshot there
    A[:40] + Y,  # 3: waits for 2's prefix in flight, then starts at 40
    A[:100],  # 4: starts at 40 (what the cache knows), snapshot at 96 (last boundary below 100)
    A[:100],  # 5: identical to 4: waits for it, starts at 96, prefills 4 tokens
    A[:60],  # 6: a prefix of 4: starts at 40 (no snapshot at 56 yet), snapshot at 56
    B,  # 7: snapshot at 24
    B + Z,  # 8: 7 is a prefix of it: starts at 24
    A[:3] + W,  # 9: shares less than a block with A: nothing
    R,  # 10: unrelated
    A[:100] + V,  # 11: shares 100 with 4: starts at 96
]
CACHED = [0, 0, 0, 40, 40, 96, 40, 0, 24, 0, 0, 96]
NEW = [3, 2, 4, 1, 3, 2, 5, 2, 3, 4, 2, 3]
cli = CliRunner()


class CountingRunner:
    """The runner, counting the token rows it computes."""

    def __init__(self, runner) -> None:
        self.runner, self.rows, self.device = runner, 0, getattr(runner, "device", None)

    def infer(self, feeds):
        self.rows += len(feeds["input_ids"])
        return self.runner.infer(feeds)


def run(runner, **options):
    counting = CountingRunner(runner)
    opts = ServeOptions(max_sequences=4, block_size=8, max_step_tokens=256, keep_logits=True, **options)
    return serve(counting, CFG, PROMPTS, SamplingOptions(), opts, max_new_tokens=NEW), counting.rows


def assert_same(got, want, where: str) -> None:
    for g, w in zip(got, want):
        assert g.tokens == w.tokens, f"{where}: prompt {g.index}"
        for j, (a, e) in enumerate(zip(g.logits, w.logits)):
            assert_close(a, e, torch.float32, what=f"{where}: prompt {g.index} token {j}")


@pytest.mark.parametrize("backend", ["pt2", "ort"])
def test_prefix_cache_keeps_tokens_and_skips_the_cached_prefill(serving_export, backend):
    runner = serving_runner(backend, serving_export)
    plain, plain_rows = run(runner)
    cached, cached_rows = run(runner, prefix_cache=True)
    assert plain_rows == sum(map(len, PROMPTS)) + sum(NEW) - len(NEW)  # every prompt token, every fed-back token
    assert [r.cached for r in cached] == CACHED
    assert cached_rows == plain_rows - sum(CACHED) == plain_rows - 336
    assert_same(cached, plain, f"{backend} --prefix-cache")
    small, small_rows = run(runner, prefix_cache=True, prefix_cache_bytes=30_000)  # ~1 snapshot + a few blocks
    assert 0 < sum(r.cached for r in small) < sum(CACHED) and small_rows == plain_rows - sum(r.cached for r in small)
    assert_same(small, plain, f"{backend} --prefix-cache under a small budget")


def test_cli_reports_the_hit_rate_and_saved_tokens(serving_export, tmp_path):
    (tmp_path / "p.jsonl").write_text("".join(json.dumps({"prompt_ids": p}) + "\n" for p in PROMPTS))
    outs = {}
    for flags in ([], ["--prefix-cache"]):
        out = tmp_path / f"out{len(flags)}.json"
        r = cli.invoke(app, ["run", str(serving_export), "--backend", "ort", "--prompts", str(tmp_path / "p.jsonl"),
                             "--max-new-tokens", "3", "--max-sequences", "4", "--json", str(out), *flags])
        assert r.exit_code == 0, r.output
        outs[len(flags)] = json.loads(out.read_text())
    plain, cached = outs[0], outs[1]
    assert [x["tokens"] for x in cached] == [x["tokens"] for x in plain]
    assert "cached_tokens" not in plain[0]
    saved = sum(x["cached_tokens"] for x in cached)
    hits = sum(x["cached_tokens"] > 0 for x in cached)
    assert hits == 6 and saved == sum(CACHED)
    total = sum(map(len, PROMPTS))
    assert (f"prefix cache: 6/12 requests hit (50 %), {saved:,} of {total:,} prompt tokens from the cache, "
            f"{total - saved:,} prefilled") in r.output
