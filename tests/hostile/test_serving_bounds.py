"""Hostile bounds on the serving path (runtime/serve_bounds.py), checked before anything is loaded or
allocated, as the batch path checks them: each flag against the export's traced serving dims, each request
against the model's context (k3-mini: 4,096 positions), one line naming the flag (or the file and line) and the
limit; huge ids are refused as ids; an export whose block size no run could fill is refused at export."""

from __future__ import annotations

import json

import pytest
from hostile_util import k3x


def _one_line(code: int, out: str, *needles: str) -> None:
    lines = [ln for ln in out.strip().splitlines() if not ln.startswith(("note: ", "[config]"))]
    assert code == 1 and len(lines) == 1 and lines[0].startswith("error: "), out[-800:]
    assert all(n in lines[0] for n in needles) and "CRASH" not in out, out[-800:]


@pytest.mark.parametrize("flags, needles", [
    (["--max-sequences", "5000"], ["--max-sequences 5000", "maximum of 1024 sequences"]),
    (["--cache-blocks", str(10 ** 12)], [f"--cache-blocks {10 ** 12}", "maximum of 4194304 blocks"]),
    (["--max-step-tokens", str(10 ** 6)], ["--max-step-tokens 1000000", "maximum of 65536 tokens"]),
    (["--max-new-tokens", str(10 ** 9)], ["--max-new-tokens 1,000,000,000", "context of 4,096"]),
    (["--prefix-cache", "--prefix-cache-mb", "inf"], ["--prefix-cache-mb inf: must be a finite number >= 0"]),
    (["--prefix-cache", "--prefix-cache-mb", "nan"], ["--prefix-cache-mb nan: must be a finite number >= 0"]),
    (["--speculate", "ngram:100000"], ["--speculate", "under --max-step-tokens 512"]),
    (["--prompt-ids", "1" + "0" * 5000], ["--prompt-ids: an id of 5,001 characters"]),
])
def test_a_serving_flag_over_its_bound_is_one_line(serving_export, flags, needles):
    _one_line(*k3x("run", serving_export, "--backend", "pt2", *flags), *needles)


@pytest.mark.parametrize("request_, needles", [
    ({"prompt_ids": [1] * 20000}, ["p.jsonl:2: 20,000 prompt tokens, over the model's context of 4,096"]),
    ({"prompt_ids": [1] * 4000, "max_tokens": 200}, ["p.jsonl:2: max_tokens 200", "4,199 positions", "4,096"]),
])
def test_a_request_over_the_context_is_one_line(serving_export, tmp_path, request_, needles):
    (tmp_path / "p.jsonl").write_text('{"prompt_ids": [1]}\n' + json.dumps(request_) + "\n")
    _one_line(*k3x("run", serving_export, "--backend", "pt2", "--prompts", tmp_path / "p.jsonl"), *needles)


def test_an_unusable_block_size_is_refused_at_export(tmp_path):
    out = tmp_path / "x"
    _one_line(*k3x("export", "--preset", "k3-mini", "--serving", "--no-weights", "--block-size", str(10 ** 9),
                   "--out", out), "--block-size 1000000000", "context of 4096")
    assert not out.exists()
