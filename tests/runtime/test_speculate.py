"""Speculative decoding on exported serving steps (pt2 and ONNX Runtime, fp32, CPU, k3-mini): greedy tokens
with n-gram drafts and with a draft export equal plain greedy decoding, for 12 prompts (repetitive ones,
random ones, long prompts prefilled in chunks, max-new-tokens and EOS falling mid-draft); drafts really get
accepted; a rollback that writes a rejected step's KDA rows back, or a draft model that skips its restore,
is caught. The target is an "echo" k3-mini (bench/speculate.py: lm_head tied to the embedding, block outputs
scaled by 0.5: it mostly repeats, sometimes not, so drafts are both accepted and rejected); the draft export
is a different-seed echo model with block outputs scaled by 0.7 (its drafts depend on its state, so a draft
state left holding rejected drafts proposes differently)."""

from __future__ import annotations

import json

import pytest
from serving_cases import prompts
from typer.testing import CliRunner

from k3x.bench.speculate import export_echo
from k3x.cli import app
from k3x.model import preset
from k3x.runtime import speculate
from k3x.runtime.scheduler import Step
from k3x.runtime.serve import ServeOptions, serve, serving_runner
from k3x.runtime.speculate import ModelDrafter, NgramDrafter, lookup
from k3x.text.sampling import SamplingOptions

CFG = preset("k3-mini")
REPEAT = [[1, 2, 3, 4, 5] * 6, [7, 8] * 10, [9] * 12, [3, 1, 4, 1, 5, 9, 2, 6] * 3, [11, 12, 13] * 12, [5] * 3]
PROMPTS = REPEAT + prompts([1, 60, 17, 2, 33, 9], CFG.vocab_size, seed=4)
NEW = [12, 10, 7, 13, 9, 5, 4, 3, 8, 6, 5, 9]  # not multiples of K + 1: the last draft is cut short
OPTS = ServeOptions(max_sequences=4, block_size=8, max_step_tokens=32)
cli = CliRunner()


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return export_echo("k3-mini", 0.5, tmp_path_factory.mktemp("echo"), block_size=8, targets=("pt2", "onnx"))


@pytest.fixture(scope="module")
def plain(target):
    """Plain greedy tokens of a backend (run once, when first asked for)."""
    cache = {}

    def tokens(backend: str) -> list[list[int]]:
        if backend not in cache:
            cache[backend] = [r.tokens for r in run(target, backend, None)]
        return cache[backend]
    return tokens


def eos_of(tokens: list[list[int]]) -> int:
    """An id that stops some prompts mid-run (from their fourth token on)."""
    return next(t for ts in tokens for t in ts[3:] if t not in ts[:3])


def run(target, backend: str, drafter, eos: tuple[int, ...] = ()):
    return serve(serving_runner(backend, target), CFG, PROMPTS, SamplingOptions(eos_token_ids=eos), OPTS,
                 max_new_tokens=NEW, drafter=drafter)


def cut(tokens: list[int], eos: int) -> list[int]:
    return tokens[: tokens.index(eos) + 1] if eos in tokens else tokens


def test_lookup_proposes_what_followed_the_latest_match():
    assert lookup([1, 2, 3, 9, 1, 2, 3, 7, 1, 2, 3], 3, 2) == [7, 1]
    assert lookup([5, 6, 5, 6], 3, 5) == [5, 6, 5, 6, 5]  # continued periodically
    assert lookup([1, 2, 3], 3, 4) == []


@pytest.mark.parametrize("backend", ["pt2", "ort"])
def test_ngram_speculation_equals_greedy(target, plain, backend):
    want = plain(backend)
    records = run(target, backend, NgramDrafter(4))
    assert [r.tokens for r in records] == want
    repetitive = [r.counts for r in records[: len(REPEAT)]]
    assert sum(c.accepted for c in repetitive) > 0 and sum(c.tokens for c in repetitive) > sum(c.steps for c in
                                                                                                repetitive)
    assert sum(c.drafted - c.accepted for c in repetitive) > 0  # rejections too: the rollback ran
    eos = eos_of(want)
    stopped = run(target, backend, NgramDrafter(4), eos=(eos,))
    assert [r.tokens for r in stopped] == [cut(t, eos) for t in want]
    assert any(len(r.tokens) < n for r, n in zip(stopped, NEW))


@pytest.mark.parametrize("backend", ["pt2", "ort"])
def test_draft_export_speculation_equals_greedy(target, draft_export, plain, backend):
    want = plain(backend)
    records = run(target, backend, ModelDrafter(serving_runner("ort", draft_export), CFG, 3, block_size=4))
    assert [r.tokens for r in records] == want
    counts = [r.counts for r in records]
    assert 0 < sum(c.accepted for c in counts) < sum(c.drafted for c in counts)
    if backend == "pt2":
        return  # EOS mid-draft once (pt2 steps are slow on the CPU); n-gram checks it on both
    eos = eos_of(want)
    stopped = run(target, backend, ModelDrafter(serving_runner("ort", draft_export), CFG, 3, block_size=4), eos=(eos,))
    assert [r.tokens for r in stopped] == [cut(t, eos) for t in want]


def test_a_rollback_that_keeps_rejected_rows_is_caught(target, plain, monkeypatch):
    monkeypatch.setattr(Step, "advances", lambda self, tokens: [True] * len(self.seqs))
    records = run(target, "ort", NgramDrafter(4))
    assert [r.tokens for r in records] != plain("ort")


def test_draft_model_proposes_its_own_greedy_continuation(target, draft_export, monkeypatch):
    """Every proposal equals the draft model's plain greedy continuation of the committed tokens (a draft
    state left holding rejected drafts, e.g. without the restore, proposes something else)."""
    seen = []
    real = speculate.ModelDrafter.propose

    def spy(self, sched):
        real(self, sched)
        seen.extend([([*s.request.prompt, *s.tokens], list(s.draft)) for s in sched.running.values() if s.draft])

    monkeypatch.setattr(speculate.ModelDrafter, "propose", spy)
    drunner = serving_runner("ort", draft_export)
    run(target, "ort", ModelDrafter(drunner, CFG, 3, block_size=4))
    sample = seen[:: max(1, len(seen) // 12)]
    fresh = serve(drunner, CFG, [c for c, _ in sample], SamplingOptions(), ServeOptions(block_size=4),
                  max_new_tokens=[len(d) for _, d in sample])
    assert [r.tokens for r in fresh] == [d for _, d in sample]


def test_cli_speculates_with_the_same_tokens(target, draft_export, tmp_path):
    (tmp_path / "p.jsonl").write_text("".join(json.dumps({"prompt_ids": p}) + "\n" for p in PROMPTS[:4]))
    got = {}
    for name, flags in (("plain", []), ("ngram", ["--speculate", "ngram:3"]),
                        ("draft", ["--draft", str(draft_export), "--speculate-tokens", "2"])):
        out = tmp_path / f"{name}.json"
        r = cli.invoke(app, ["run", str(target), "--backend", "ort", "--prompts", str(tmp_path / "p.jsonl"),
                             "--max-new-tokens", "9", "--json", str(out), *flags])
        assert r.exit_code == 0, r.output
        got[name] = json.loads(out.read_text())
        assert ("drafts accepted" in r.output and "tokens per step" in r.output) == bool(flags)
    want = [x["tokens"] for x in got["plain"]]
    for name in ("ngram", "draft"):
        assert [x["tokens"] for x in got[name]] == want, name
        assert sum(x["accepted"] for x in got[name]) > 0 and all(x["steps"] <= 9 for x in got[name])


@pytest.mark.parametrize("flags, message", [
    (["--speculate", "ngram:4", "--temperature", "0.7"], "temperature=0.7: speculative decoding is greedy only"),
    (["--speculate", "bigram:2"], "--speculate 'bigram:2': expected ngram:K"),
    (["--speculate", "ngram:2", "--draft", "DRAFT"], "--speculate and --draft: give one of them"),
])
def test_cli_refuses_bad_speculation_in_one_line(target, draft_export, tmp_path, flags, message):
    (tmp_path / "p.jsonl").write_text('{"prompt_ids": [1, 2, 3]}\n')
    flags = [str(draft_export) if f == "DRAFT" else f for f in flags]
    r = cli.invoke(app, ["run", str(target), "--backend", "ort", "--prompts", str(tmp_path / "p.jsonl"),
                         "--json", str(tmp_path / "o.json"), *flags])
    assert r.exit_code == 1 and message in r.output and "Traceback" not in r.output, r.output
    assert not (tmp_path / "o.json").exists()


SHARED = REPEAT[0] + REPEAT[1]  # 50 tokens: prefixes of 0, 8, 16, 24, 40 and 50 tokens are shared below
PREFIXED = [SHARED[:n] + p for n, p in zip([50, 50, 40, 24, 8, 50, 16, 0, 40, 50, 24, 3],
                                           prompts([3, 1, 9, 20, 5, 3, 12, 30, 2, 17, 6, 4], CFG.vocab_size, seed=7))]


@pytest.mark.parametrize("backend", ["pt2", "ort"])
def test_prefix_cache_and_speculation_together_equal_greedy(target, draft_export, backend):
    """12 prompts sharing prefixes of different lengths: greedy tokens with the prefix cache, with n-gram
    drafts, with a draft export, and with the cache and each drafter at once, all equal plain greedy."""
    def tokens(drafter, cache: bool):
        opts = ServeOptions(max_sequences=4, block_size=8, max_step_tokens=32, prefix_cache=cache,
                            prefix_cache_bytes=1 << 30 if cache else 0)
        stats: dict = {}
        records = serve(serving_runner(backend, target), CFG, PREFIXED, SamplingOptions(), opts,
                        max_new_tokens=NEW, drafter=drafter, stats=stats)
        assert not cache or sum(r.cached for r in records) > 0, "the prefix cache never hit"
        return [r.tokens for r in records], records

    want, _ = tokens(None, False)
    cases = [("prefix cache", None, True), ("ngram + prefix cache", NgramDrafter(4), True)]
    if backend == "ort":  # the draft export alone and with the cache (pt2 steps are slow on the CPU)
        cases += [("ngram", NgramDrafter(4), False),
                  ("draft + prefix cache", ModelDrafter(serving_runner("ort", draft_export), CFG, 3, block_size=4),
                   True)]
    for name, drafter, cache in cases:
        got, records = tokens(drafter, cache)
        assert got == want, name
        if drafter is not None:
            assert sum(r.counts.accepted for r in records) > 0, f"{name}: no draft accepted"
