"""The serving benches (bench/serving*.py) run end to end at a tiny size on the session's k3-mini serving
export (tests/conftest.py `serving_export`; they read its ONNX; the length split reads a flat export of its own),
so they cannot rot: each writes its JSON, and its figures hang together (medians inside their spread, the
profile's split covering the step, the pools predicted by pool_bytes)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from k3x.bench import serving, serving_length, serving_long, serving_mixed, serving_parts, serving_prefill

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


@pytest.fixture(scope="module")
def mini_serving(tmp_path_factory) -> Path:
    from k3x.exporter.options import ExportOptions, Target
    from k3x.exporter.pipeline import export

    out = tmp_path_factory.mktemp("serving-bench") / "x"
    # flat layers: serving_length attributes the profile's inlined k3 bodies to their callers in the main graph
    export(ExportOptions((Target.ONNX,), out, preset="k3-mini", serving=True, block_size=8, onnx_functions=False))
    return out


def _run(main, export: Path, tmp_path: Path, *args: str) -> dict:
    out = tmp_path / "r.json"
    r = main(["--export", str(export), "--json", str(out), *args])
    assert json.loads(out.read_text()) == json.loads(json.dumps(r))
    return r


def _spread_ok(s: dict) -> None:
    assert 0 < s["low"] <= s["median"] <= s["high"]


def test_capacity_and_batching(serving_export, tmp_path):
    r = _run(serving.main, serving_export, tmp_path, "--small", "256", "--large", "65536", "--batch", "3",
             "--positions", "8", "--rounds", "2", "--repeats", "1")
    for k in ("decode_ms_small_pool", "decode_ms_large_pool", "capacity_ratio", "batching_speedup",
              "tokens_per_s_batch", "batching_speedup_scattered"):
        _spread_ok(r[k])
    assert r["large_pool_bytes"] > 65536 * 4 * 32  # k3-mini: 3 MLA layers x 32 fp32 latents per position


def test_mixed_workload(serving_export, tmp_path):
    """Every kind of step occurs (decode rows only, chunks only, both), all in consecutive slots (serve()
    closes the gaps finished sequences leave), and both rounds give the same tokens (else it raises)."""
    r = _run(serving_mixed.main, serving_export, tmp_path, "--prompts", "10", "--max-prompt", "40", "--max-new", "12",
             "--sequences", "4", "--step-tokens", "24", "--rounds", "2")
    _spread_ok(r["seconds"])
    _spread_ok(r["new_tokens_per_s"])
    assert all(r["steps_by_kind"][k] > 0 for k in ("decode", "prefill", "mixed")), r["steps_by_kind"]
    assert sum(r["steps_by_kind"].values()) == r["steps"] and r["consecutive_share"] == 1.0
    assert 10 * 8 <= r["new_tokens"] <= 10 * 12


@pytest.mark.parametrize("library", ["bodies", "kernels"])
def test_length_split(mini_serving, tmp_path, request, monkeypatch, library):
    """With the kernel library (the k3x.fused calls run as kernels) and without it (their bodies inlined, and
    MoEDispatch's inside k3::MoE's, named without its caller: bench/serving_steps.py `inlined_callers`)."""
    if library == "kernels":
        request.getfixturevalue("kernels")
    else:
        monkeypatch.setenv("K3X_ORT_KERNELS", "0")
    r = _run(serving_length.main, mini_serving, tmp_path, "--lengths", "16,200", "--rounds", "2", "--repeats", "1")
    assert [x["positions"] for x in r["rows"]] == [16, 200]
    for x in r["rows"]:
        _spread_ok(x["step_ms"])
        assert 0 < x["kda_mixer_ms"] < x["kda_ms"] and 0 < x["mla_mixer_ms"] < x["mla_ms"]
        assert x["other_ms"] > 0 and (x["kda_layers"], x["mla_layers"]) == (3, 3)


@pytest.mark.parametrize("library", ["bodies", "kernels"])
def test_batching_split_by_part(mini_serving, tmp_path, request, monkeypatch, library):
    """Every part of both steps gets time (the k3 calls as kernels, and as inlined bodies), and their sum, node
    kernel time, lies within the step's wall time (no node counted twice, e.g. a Loop and its body's nodes)."""
    if library == "kernels":
        request.getfixturevalue("kernels")
    else:
        monkeypatch.setenv("K3X_ORT_KERNELS", "0")
    r = _run(serving_parts.main, mini_serving, tmp_path, "--batch", "3", "--positions", "8", "--small", "64",
             "--rounds", "2", "--repeats", "1")
    rows = {x["part"]: x for x in r["rows"]}
    assert list(rows) == [*serving_parts.PARTS, "all", serving_parts.GEMM_NODES, serving_parts.REST]
    gemms, rest = serving_parts.GEMM_NODES, serving_parts.REST
    for key, step in (("ms_1", "step_ms_1"), ("ms_batch", "step_ms_batch")):
        assert all(rows[p][key] > 0 for p in serving_parts.PARTS), rows
        assert rows["all"][key] < r[step], (rows["all"], r[step])
        # the GEMM nodes across the parts: at least the head's and the dense ones' (2 timed runs a case here: the
        # medians are means, so per-run sums carry over), never all of the step
        assert rows["lm_head"][key] + rows["dense GEMMs"][key] <= rows[gemms][key] * (1 + 1e-9), rows
        assert rows[gemms][key] < rows["all"][key], rows
        assert rows[rest][key] == pytest.approx(rows["all"][key] - rows[gemms][key])


def test_prefill_against_gemm_bound(serving_export, tmp_path, monkeypatch):
    """The figures, and the top ops of the profile: from a second, profiled session opened after the timed
    rounds, which run on a session without the profiler (its per-node cost would be in the timed figure)."""
    opened, open_at_timing = [], []
    real_open, real_rounds = serving_prefill.open_serving, serving_prefill.timed_rounds

    def open_serving(path, threads, profile=None):
        opened.append(profile)
        return real_open(path, threads, profile=profile)

    def timed_rounds(*args):
        open_at_timing.extend(opened)
        return real_rounds(*args)

    monkeypatch.setattr(serving_prefill, "open_serving", open_serving)
    monkeypatch.setattr(serving_prefill, "timed_rounds", timed_rounds)
    r = _run(serving_prefill.main, serving_export, tmp_path, "--prompt", "32", "--rounds", "2", "--repeats", "1")
    assert open_at_timing == [None] and len(opened) == 2 and opened[1] is not None, (open_at_timing, opened)
    for k in ("ort_tokens_per_s", "gemm_bound_tokens_per_s", "gemm_ort_ms", "efficiency", "efficiency_best_bound"):
        _spread_ok(r[k])
    # the best bound is the fastest of the three GEMM passes: never above the torch-only efficiency
    assert r["efficiency_best_bound"]["median"] <= r["efficiency"]["median"] + 1e-12
    ops = r["top_ops"]
    assert ops and all(": " in o["op"] for o in ops) and 0 < sum(o["share"] for o in ops) <= 1 + 1e-9
    assert not any(o["op"].endswith(": Loop") for o in ops)  # a Loop's body is counted, not the Loop too


def test_gemm_shapes_cover_the_model():
    from k3x.model import build_model, preset

    cfg = preset("k3-mini")
    shapes = serving_prefill.gemm_shapes(cfg, 64)
    weights = sum(p.numel() for n, p in build_model(cfg, device="meta", seed=None).named_parameters()
                  if (p.dim() == 2 and "embed_tokens" not in n) or "experts" in n)
    assert sum(c * i * o for c, _, i, o in shapes) == weights  # every matrix once (embeddings, convs aside)
    assert (1, 1, cfg.hidden_size, cfg.vocab_size) in shapes  # the head on the one logits row


def test_long_prompt_memory(serving_export, tmp_path):
    from k3x.model import preset
    from k3x.model.state import pool_bytes
    from k3x.model.working import step_working_bytes

    r = _run(serving_long.main, serving_export, tmp_path, "--prompt", "300", "--chunk", "64", "--new-tokens", "3",
             "--target", "ort")
    assert (r["new_tokens"], r["steps"], r["positions"]) == (3, 5 + 2, 302)  # 5 chunks, 2 decode steps
    import torch

    assert r["predicted_pool_bytes"] == pool_bytes(preset("k3-mini"), 302, 1, 8, dtype=torch.float32)["total_bytes"]
    assert r["predicted_step_bytes"] == step_working_bytes(preset("k3-mini"), 64, 8)["total_bytes"]
    assert r["peak_bytes"] >= r["steady_bytes"] > 0


def test_long_prompt_tail(serving_export, tmp_path):
    r = _run(serving_long.main, serving_export, tmp_path, "--prompt", "1000", "--chunk", "100", "--new-tokens", "2",
             "--tail", "--target", "ort")
    assert (r["tail"], r["steps"], r["positions"]) == (True, 2, 1001)  # the last chunk, one decode step
    assert r["peak_bytes"] >= r["steady_bytes"] >= r["predicted_pool_bytes"] > 0  # the pools' pages are written


def test_profile_attribution_refuses_layer_functions(serving_export):
    """A serving export holds its layers as ONNX functions by default; the profile split needs a flat one."""
    from k3x.bench.serving_steps import function_callers

    with pytest.raises(ValueError, match=r"layers are ONNX functions; .*--no-onnx-functions"):
        function_callers(serving_export / "model.onnx")
