"""plan/dispatch.py: the pick per (op, shape class) from a fake device's table, the default order without one,
absent candidates skipped and reported, forced candidates, malformed tables refused; and the families' wiring
(k3::kda and k3::moe's CUDA paths call what the table picks, one graph node either way)."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from k3x.plan.dispatch import FORMAT, Candidate, Dispatcher, DispatchError, bucket, gpu_kind, read_table


def table(tmp_path, kind: str, ops: dict) -> None:
    (tmp_path / f"{kind}.json").write_text(json.dumps({"format": FORMAT, "kind": kind, "ops": ops}))


def fake(name: str, requires: str | None = None) -> Candidate:
    return Candidate(name, lambda *a: name, requires=requires)


CANDS = (fake("own"), fake("field"), fake("ghost", requires="k3x_no_such_package"))


def test_gpu_kind_and_buckets():
    assert gpu_kind("NVIDIA H100 80GB HBM3") == "H100"
    assert gpu_kind("NVIDIA H200") == "H200"
    assert gpu_kind("NVIDIA B200") == "B200"
    assert gpu_kind("NVIDIA GH200 480GB") == "GH200-480GB"  # unknown kinds keep their own name
    assert [bucket(n, (1, 8, 64), "B") for n in (1, 2, 64, 65)] == ["B<=1", "B<=8", "B<=64", "B>64"]


def test_table_pick_per_class(tmp_path, caplog):
    table(tmp_path, "H200", {"op": {"B<=1": {"order": ["field", "own"]}, "B<=64": {"order": ["own"]}}})
    d = Dispatcher(tmp_path, lambda: "H200")
    with caplog.at_level(logging.INFO, "k3x.dispatch"):
        assert d.pick("op", "B<=1", CANDS, ("own",)).name == "field"
        assert d.pick("op", "B<=64", CANDS, ("own",)).name == "own"
        assert d.pick("op", "B>64", CANDS, ("own", "field")).name == "own"  # no entry: the default order
    assert [(p.shape_class, p.name, p.reason) for p in d.picks()] == [
        ("B<=1", "field", "table H200"), ("B<=64", "own", "table H200"),
        ("B>64", "own", "default order (no table entry for H200)")]
    assert "dispatch op [B<=1]: field (table H200)" in caplog.text


def test_no_table_is_the_default_order(tmp_path):
    table(tmp_path, "H200", {"op": {"B<=1": {"order": ["field"]}}})
    d = Dispatcher(tmp_path, lambda: "H100")  # a table for another kind is not read
    assert d.pick("op", "B<=1", CANDS, ("own", "field")).name == "own"


def test_absent_candidate_is_skipped_and_reported(tmp_path, caplog):
    table(tmp_path, "H200", {"op": {"B<=1": {"order": ["ghost", "field"]}, "B<=8": {"order": ["ghost"]}}})
    d = Dispatcher(tmp_path, lambda: "H200")
    with caplog.at_level(logging.WARNING, "k3x.dispatch"):
        assert d.pick("op", "B<=1", CANDS, ("own",)).name == "field"
    assert d.picks()[0].skipped == ("ghost: k3x_no_such_package is not installed",)
    assert "skipped ghost: k3x_no_such_package is not installed" in caplog.text
    with pytest.raises(DispatchError, match=r"op \[B<=8\]: no candidate can run .*ghost"):
        d.pick("op", "B<=8", CANDS, ("own",))  # the table allows only ghost: no silent fallback to own


def test_a_candidate_the_table_does_not_list_is_never_picked(tmp_path):
    table(tmp_path, "H200", {"op": {"B<=1": {"order": ["retired", "own"]}}})
    d = Dispatcher(tmp_path, lambda: "H200")
    assert d.pick("op", "B<=1", (fake("field"), fake("own")), ("field",)).name == "own"


def test_forced(tmp_path):
    d = Dispatcher(tmp_path, lambda: "H200")
    with d.forced("op", "field"):
        assert d.pick("op", "B<=1", CANDS, ("own",)).name == "field"
        with pytest.raises(DispatchError, match="forced candidate 'ghost' cannot run"):
            with d.forced("op", "ghost"):
                d.pick("op", "B<=1", CANDS, ("own",))
    assert d.pick("op", "B<=1", CANDS, ("own",)).name == "own"
    assert [p.name for p in d.picks()] == ["own"]  # forced runs are not recorded as picks


@pytest.mark.parametrize("body, match", [
    ("{", "not a readable JSON table"), ('{"format": 99, "ops": {}}', "format must be 1"),
    ('{"format": 1}', "'ops' must be an object"),
    ('{"format": 1, "ops": {"op": {"B<=1": {"order": []}}}}', r"ops\.op\.B<=1\.order must be a non-empty list")])
def test_malformed_table_is_refused_with_its_path(tmp_path, body, match):
    (tmp_path / "H200.json").write_text(body)
    with pytest.raises(DispatchError, match=match) as err:
        read_table(tmp_path / "H200.json")
    assert str(tmp_path / "H200.json") in str(err.value)


def test_families_call_the_pick(tmp_path, monkeypatch):
    """k3::kda (prefill and decode), k3::kda_packed, k3::moe and k3::attn_res' CUDA paths run the candidate the
    table picks for their class
    (fakes stand for the kernels: this is the wiring, the kernels' parity is tests/custom_ops/kernels)."""
    from k3x.custom_ops.attn_res import candidates as attn
    from k3x.custom_ops.kda import candidates as kda
    from k3x.custom_ops.kda_packed import candidates as packed
    from k3x.custom_ops.moe import candidates as moe

    table(tmp_path, "H200", {"kda.prefill": {"bf16-tokens<=4096": {"order": ["fla-chunk", "k3x"]}},
                             "kda.decode": {"bf16-rows<=64": {"order": ["k3x-b"]}},
                             "moe.experts": {"bf16-tokens<=8192": {"order": ["grouped_mm", "k3x"]}},
                             "attn_res.mix": {"bf16-S9-R<=8192": {"order": ["k3x-2048x4", "k3x"]}},
                             "kda_packed.step": {"bf16-tokens<=4096": {"order": ["fla-chunk-varlen", "k3x"]},
                                                 "bf16-short-B<=8": {"order": ["fla-recurrent-varlen"]}}})
    d = Dispatcher(tmp_path, lambda: "H200")
    monkeypatch.setattr(kda, "DISPATCH", d)
    monkeypatch.setattr(moe, "DISPATCH", d)
    monkeypatch.setattr(kda, "CANDIDATES", {kda.PREFILL: (fake("k3x"), fake("fla-chunk")),
                                            kda.DECODE: (fake("k3x"), fake("k3x-b"))})
    monkeypatch.setattr(moe, "CANDIDATES", (fake("k3x"), fake("grouped_mm")))
    q = torch.zeros(1, 4096, 1, 1, dtype=torch.bfloat16)
    assert kda.kda(q, q, q, q, q, 1.0, q, -5.0) == "fla-chunk"
    assert kda.kda(q.float(), q, q, q, q, 1.0, q, -5.0) == "k3x"  # fp32: no bf16 entry applies
    step = torch.zeros(64, 1, 1, 1, dtype=torch.bfloat16)
    assert kda.kda(step, step, step, step, step, 1.0, step, -5.0) == "k3x-b"
    z = torch.zeros(5000, 2, dtype=torch.bfloat16)
    assert moe.moe(z, z) == "grouped_mm"
    monkeypatch.setattr(attn, "DISPATCH", d)
    monkeypatch.setattr(attn, "CANDIDATES", (fake("k3x"), fake("k3x-2048x4")))
    rows, bank = torch.zeros(8192, 4, dtype=torch.bfloat16), torch.zeros(8192, 8, 4, dtype=torch.bfloat16)
    assert attn.attn_res(rows, bank, None, None, 1e-6) == "k3x-2048x4"
    monkeypatch.setattr(packed, "DISPATCH", d)
    monkeypatch.setattr(packed, "SHORT", (fake("k3x"), fake("fla-recurrent-varlen")))
    monkeypatch.setattr(packed, "MIXED", (fake("k3x"), fake("fla-chunk-varlen")))
    rows, one = torch.zeros(4096, 1, 1, dtype=torch.bfloat16), torch.zeros(1, dtype=torch.int32)
    assert packed.kda_packed(rows, rows, rows, rows, rows, rows, one, one, 1.0, -5.0) == "fla-chunk-varlen"
    steps = torch.zeros(64, 1, 1, dtype=torch.bfloat16)
    assert packed.kda_packed(steps, steps, steps, steps, steps, steps, one, torch.zeros(64), 1.0, -5.0) == "k3x"
    assert {p.op for p in d.picks()} == {"kda.prefill", "kda.decode", "moe.experts", "attn_res.mix", "kda_packed.step"}


def test_candidate_names_are_distinct_and_defaults_exist():
    from k3x.custom_ops.attn_res import candidates as attn
    from k3x.custom_ops.kda import candidates as kda
    from k3x.custom_ops.moe import candidates as moe

    from k3x.custom_ops.kda_packed import candidates as packed

    defaults = kda.DEFAULT | {moe.EXPERTS: moe.DEFAULT, attn.MIX: attn.DEFAULT, packed.STEP: packed.DEFAULT}
    for op, cands in [*kda.CANDIDATES.items(), (moe.EXPERTS, moe.CANDIDATES), (attn.MIX, attn.CANDIDATES),
                      (packed.STEP, packed.SHORT), (packed.STEP, packed.MIXED)]:
        names = [c.name for c in cands]
        assert len(set(names)) == len(names), op
        default = defaults[op]
        assert set(default) <= set(names) and all(cands[names.index(n)].requires is None for n in default), op
