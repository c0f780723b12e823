"""bench/llama_cpp.py's pieces that need no llama.cpp: a GGUF's step bytes (the embedding table out, top_k of
num_experts of each routed experts' tensor), llama-bench's records turned into the children's figures (a record
of the wrong kind refused), the medians and share, a checkout missing its pieces named, and bench/cpu_decode.py's
rounds with llama.cpp in them (its runs beside their forms, its floor at the round's rate)."""

from __future__ import annotations

from pathlib import Path

import pytest

from k3x.bench.llama_cpp import LlamaCpp, figures, gguf_step_bytes, summary


def test_a_step_reads_all_but_the_embedding_and_top_k_of_the_experts():
    tensors = [("token_embd.weight", 1000), ("output.weight", 1000), ("blk.0.attn_q.weight", 64),
               ("blk.1.ffn_gate_exps.weight", 1600), ("blk.1.ffn_down_exps.weight", 800),
               ("blk.1.ffn_gate_shexp.weight", 32), ("output_norm.weight", 4)]
    assert gguf_step_bytes(tensors, 4, 16) == 1000 + 64 + 400 + 200 + 32 + 4
    assert gguf_step_bytes(tensors, 16, 16) == 1000 + 64 + 1600 + 800 + 32 + 4


def _record(n_prompt, n_gen, n_depth, samples_ts):
    return {"n_prompt": n_prompt, "n_gen": n_gen, "n_depth": n_depth, "samples_ts": samples_ts,
            "build_commit": "abc1234"}


def test_llama_bench_records_become_seconds_per_prompt_and_per_token():
    pre = [_record(128, 0, 0, [400.0]), _record(2048, 0, 0, [256.0])]
    dec = [_record(0, 16, 128, [100.0]), _record(0, 16, 2048, [50.0])]
    got = figures(pre, dec)
    assert got[128]["prefill_s"] == pytest.approx([0.32]) and got[2048]["prefill_s"] == pytest.approx([8.0])
    assert got[128]["decode_s"] == pytest.approx([0.01]) and got[2048]["decode_s"] == pytest.approx([0.02])
    with pytest.raises(ValueError, match="not a prefill record"):
        figures(dec, [])
    with pytest.raises(ValueError, match="not a decode record"):
        figures([], pre)


def test_the_summary_is_medians_and_floor_over_decode():
    raw = {128: {"prefill_s": [0.4, 0.2, 0.32], "decode_s": [0.011, 0.010, 0.012], "floor_ms": [5.0, 4.0, 6.0]}}
    s = summary(raw, [128])[128]
    assert s["prefill_tokens_per_s"] == pytest.approx(400.0)
    assert s["decode_ms_per_token"] == pytest.approx(11.0)
    assert s["floor_ms"] == pytest.approx(5.0) and s["floor_share"] == pytest.approx(5.0 / 11.0)


def test_a_checkout_without_its_bench_and_a_preset_out_of_k3s_layout_are_named(tmp_path):
    from k3x.model import preset

    (tmp_path / "convert_hf_to_gguf.py").write_text("")
    (tmp_path / "gguf-py").mkdir()
    with pytest.raises(SystemExit, match="no build/bin/llama-bench"):
        LlamaCpp(tmp_path, preset("k3-bench"))
    with pytest.raises(SystemExit, match="kimi-linear-mid is in Kimi Linear's layout"):
        LlamaCpp(tmp_path, preset("kimi-linear-mid"))



def test_llama_cpp_runs_right_after_its_form_each_round_at_that_rounds_floor_rate(monkeypatch):
    """measure(): llama.cpp's file of a form runs right after k3x's child of that form, in every round; its floor
    is its own bytes at the rate k3x's floor reads ran at in that round (k3x: 160 MB in 5 ms, then in 4 ms)."""
    from k3x.bench import cpu_decode, llama_cpp

    calls, rounds = [], iter([5.0, 4.0])

    def k3x_child(onnx, preset_name, depths, steps, threads, nbytes):
        calls.append(onnx.name)
        fl = next(rounds) if onnx.name == "int8.onnx" else 1.0
        return {"128": {"prefill_s": 0.25, "decode_s": [0.008] * steps, "cpu_s": [0.016] * steps,
                        "floor_ms": [fl] * steps, "kernels": True}}

    def their_file(lc, gguf, depths, steps, threads):
        calls.append(gguf.name)
        return {128: {"prefill_s": [0.4], "decode_s": [0.010]}}, "abc1234"

    monkeypatch.setattr(cpu_decode, "run_child", k3x_child)
    monkeypatch.setattr(llama_cpp, "measure_file", their_file)
    files = {"mxfp4": Path("fp32.onnx"), "mxfp4+int8": Path("int8.onnx")}
    ours, theirs = cpu_decode.measure(files, {"mxfp4": 500_000_000, "mxfp4+int8": 160_000_000}, "k3-bench", [128],
                                      2, 2, 2, object(), {"mxfp4+int8": (Path("q8_0.gguf"), 150_000_000)})
    assert calls == ["fp32.onnx", "int8.onnx", "q8_0.gguf"] * 2
    row = theirs["mxfp4+int8"]
    assert row["build"] == "abc1234" and set(theirs) == {"mxfp4+int8"}
    f = row["depths"][128]
    assert f["floor_ms"] == pytest.approx((5.0 * 150 / 160 + 4.0 * 150 / 160) / 2)
    assert f["decode_ms_per_token"] == pytest.approx(10.0) and f["prefill_tokens_per_s"] == pytest.approx(320.0)
    assert f["floor_share"] == pytest.approx(f["floor_ms"] / 10.0)
    assert ours["mxfp4+int8"][128]["decode_ms_per_token"] == pytest.approx(8.0)


def test_the_parity_check_passes_llama_cpps_logits_within_tolerance_and_stops_the_bench_beyond(tmp_path):
    """parity(): llama.cpp's logits (here a stand-in probe printing the given file) against k3x's eager model on
    the check's ids; a logit PARITY_TOL * 3 away at one position stops the bench, naming that position."""
    import os
    import stat

    import numpy as np
    import torch

    from k3x.bench.cpu_decode import same_weights
    from k3x.bench.llama_cpp import PARITY_PROMPT, PARITY_STEPS, PARITY_TOL, parity
    from k3x.model import build_model, preset
    from k3x.model.options import BuildOptions
    from k3x.runtime.generate import full_logits

    cfg = preset("k3-mini")
    packed = build_model(cfg, BuildOptions(expert_format="mxfp4"), seed=3)
    n = PARITY_PROMPT + PARITY_STEPS
    ids = torch.randint(0, cfg.vocab_size, (1, n), generator=torch.Generator().manual_seed(n))
    want = full_logits(packed, ids)[0].numpy()  # what llama.cpp would give

    class StandIn:  # llama.cpp's converter and probe: the probe prints `answer`
        def __init__(self, answer):
            self.answer = answer

        def convert(self, checkpoint, outtype, out):
            assert outtype == "f32" and (checkpoint / "config.json").is_file()
            return out

        def logits_probe(self, out):
            out.write_text(f"#!/bin/sh\ncat > /dev/null\ncat {self.answer}\n")
            os.chmod(out, os.stat(out).st_mode | stat.S_IEXEC)
            return out

    good, bad = tmp_path / "good.bin", tmp_path / "bad.bin"
    want.astype(np.float32).tofile(good)
    off = want.copy()
    off[PARITY_PROMPT + 1, 7] += 3 * PARITY_TOL
    off.astype(np.float32).tofile(bad)
    (tmp_path / "a").mkdir()
    dense = same_weights(packed, cfg)
    got = parity(StandIn(good), packed, dense, cfg, tmp_path / "a", 1)
    assert got["positions"] == n and got["max_abs"] <= 1e-6
    (tmp_path / "b").mkdir()
    with pytest.raises(SystemExit, match=f"at position {PARITY_PROMPT + 1} of {n}"):
        parity(StandIn(bad), packed, dense, cfg, tmp_path / "b", 1)
