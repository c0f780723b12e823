"""The serving step as an AOTInductor package (`k3x export --serving --target aoti`, issue 20): k3-mini compiles on
CPU (~25 s: a C++ compile) and continuous batching through the package gives the pt2 step's tokens and logits
(prompts admitted as slots free up, a long one prefilled in chunks); `k3x run --backend aoti --prompts` serves it."""

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
LENGTHS, NEW = [1, 40, 5, 17], [3, 2, 4, 2]
cli = CliRunner()


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    out = tmp_path_factory.mktemp("serving-aoti") / "k3-mini"
    r = cli.invoke(app, ["export", "--preset", "k3-mini", "--serving", "--block-size", "8", "--target", "pt2",
                         "--target", "aoti", "--out", str(out)])
    assert r.exit_code == 0, r.output
    return out


@pytest.mark.slow
def test_aoti_serving_equals_pt2(folder, tmp_path):
    ps = prompts(LENGTHS, CFG.vocab_size, seed=3)
    opts = ServeOptions(max_sequences=2, block_size=8, max_step_tokens=16, keep_logits=True)
    got = {b: serve(serving_runner(b, folder), CFG, ps, SamplingOptions(), opts, max_new_tokens=NEW)
           for b in ("pt2", "aoti")}
    for a, e in zip(got["aoti"], got["pt2"]):
        assert a.tokens == e.tokens and len(a.tokens) == NEW[a.index], f"prompt {a.index}"
        for j, (x, y) in enumerate(zip(a.logits, e.logits)):
            assert_close(x, y, torch.float32, what=f"aoti vs pt2: prompt {a.index} token {j}")
    (tmp_path / "p.jsonl").write_text("".join(json.dumps({"prompt_ids": p}) + "\n" for p in ps))
    r = cli.invoke(app, ["run", str(folder), "--backend", "aoti", "--prompts", str(tmp_path / "p.jsonl"),
                         "--max-new-tokens", "2", "--max-sequences", "2", "--json", str(tmp_path / "out.json")])
    assert r.exit_code == 0, r.output
    records = json.loads((tmp_path / "out.json").read_text())
    assert [rec["tokens"] for rec in records] == [e.tokens[:2] for e in got["pt2"]]
