"""Kernel benchmarks of bench/gpu_check.py, side by side with the anchors (copy and GEMM ceilings, KDA
prefill/decode vs fla, AttnRes vs the copy ceiling, MoE grouped GEMMs vs torch._grouped_mm); appended to its
`CHECKS`. Helpers (Result, _bench, _fla, _kda_inputs) come from the running gpu_check module."""

from __future__ import annotations

import sys


def imports() -> dict:
    """Every k3x module the benchmarks use (torch and triton besides; fla optional, through gpu_check._fla)."""
    from k3x.custom_ops.attn_res import triton as attn_res
    from k3x.custom_ops.kda import triton as kda
    from k3x.custom_ops.moe import triton as moe
    from k3x.custom_ops.moe_mxfp4 import reference as moe_mxfp4_reference, triton as moe_mxfp4
    from k3x.exporter import trace
    from k3x.model import build_model, preset
    from k3x.model.options import BuildOptions
    from k3x.plan.kernels import Kernels
    from k3x.runtime import cuda_graph, runners

    return {"kda": kda, "attn_res": attn_res, "moe": moe, "moe_mxfp4": moe_mxfp4,
            "moe_mxfp4_reference": moe_mxfp4_reference, "Kernels": Kernels, "cuda_graph": cuda_graph,
            "runners": runners, "trace": trace, "build_model": build_model, "preset": preset,
            "BuildOptions": BuildOptions}


def bench_ceilings(ctx) -> list:
    gc = sys.modules[type(ctx).__module__]  # bench/gpu_check.py, run as __main__ or imported
    if not ctx.bench:
        return []
    import torch

    src = torch.empty(2 ** 29, dtype=torch.bfloat16, device="cuda").normal_()  # 1 GiB
    dst = torch.empty_like(src)
    t_copy = gc._bench(lambda: dst.copy_(src), ctx)
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    t_mm = gc._bench(lambda: a @ b, ctx)
    ctx.copy_tbps = 2 * 2 ** 30 / t_copy / 1e9
    return [gc.Result("copy 1 GiB d2d", "bench", None, {"ms": t_copy, "TB/s": ctx.copy_tbps}),
            gc.Result("bf16 GEMM 8192^3", "bench", None, {"ms": t_mm, "TFLOP/s": 2 * 8192 ** 3 / t_mm / 1e9})]


def bench_kda(ctx) -> list:
    """Prefill (ours with K3's gate bound vs fla's chunk_kda) and decode as device time (CUDA graph of many
    launches: at B=1 a launch is ~µs, host overhead would dominate a do_bench figure)."""
    gc = sys.modules[type(ctx).__module__]  # bench/gpu_check.py, run as __main__ or imported
    if not ctx.bench:
        return []
    import torch

    kern = imports()["kda"]

    fla, note = gc._fla()
    out = []
    prefill = [(96, 4096), (96, 32768)] if ctx.quick else [(96, 4096), (96, 32768), (64, 4096), (64, 32768)]
    for H, T in prefill:
        if ctx.time_left() < 15:
            out.append(gc.Result(f"kda prefill B1-T{T}-H{H}", "info", None, note="skipped: section budget"))
            continue
        q, k, v, g, beta, h0 = gc._kda_inputs(1, T, H, 128, 128, torch.bfloat16, "cuda")
        m = {"ours_ms": gc._bench(lambda: kern.kda_chunked(q, k, v, g, beta, initial_state=h0, gate_lower_bound=-5.0),
                                  ctx)}
        if fla is not None:
            common = dict(initial_state=h0, output_final_state=True, safe_gate=True, lower_bound=-5.0)
            m["fla_ms"] = gc._bench(lambda: fla[0](q, k, v, g, beta, **common), ctx)
            m["speedup_vs_fla"] = m["fla_ms"] / m["ours_ms"]
            if not ctx.quick:
                m["fla_l2norm_ms"] = gc._bench(lambda: fla[0](q, k, v, g, beta, use_qk_l2norm_in_kernel=True,
                                                               **common), ctx)
            m["fla_autotune_configs"] = gc.FLA_AUTOTUNE_CONFIGS
        m["Mtok/s"] = T / m["ours_ms"] / 1e3
        out.append(gc.Result(f"kda prefill B1-T{T}-H{H}", "bench", None, m, note))
        del q, k, v, g, beta, h0
    for B in (1, 64):
        if ctx.time_left() < 5:
            out.append(gc.Result(f"kda decode B{B}-H96", "info", None, note="skipped: section budget"))
            continue
        q, k, v, g, beta, h0 = gc._kda_inputs(B, 1, 96, 128, 128, torch.bfloat16, "cuda")
        state = h0.clone()
        ms, how = gc.device_time(lambda: kern.kda_recurrent_(q, k, v, g, beta, state))
        m = {"ours_us": ms * 1e3, "timing": how}
        nbytes = 2 * h0.numel() * 4
        m["state_TB/s"] = nbytes / ms / 1e9
        if ctx.copy_tbps:
            m["frac_of_copy"] = m["state_TB/s"] / ctx.copy_tbps
        if fla is not None:
            fms, fhow = gc.device_time(lambda: fla[1](q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                                      use_qk_l2norm_in_kernel=True))
            m |= {"fla_us": fms * 1e3, "fla_timing": fhow}
        out.append(gc.Result(f"kda decode B{B}-H96", "bench", None, m, note))
        out.append(fused_decode(gc, ctx, B))
    return out


def fused_decode(gc, ctx, B: int):
    """k3::kda_decode (conv + gate + recurrence + gated norm, one kernel) at K3's shape, pure and in place, as
    device time, beside the anchors (FlashInfer's fused KDA decode, fla's Triton decode) and the copy ceiling."""
    import torch

    from k3x.custom_ops.kda_decode import triton as dk

    a = gc._decode_inputs(B, 96, 128, 128, torch.bfloat16, "cuda")
    attrs = {"scale": 128 ** -0.5, "eps": 1e-5, "gate_lower_bound": -5.0}
    ms, how = gc.device_time(lambda: dk.kda_decode(*a, **attrs))
    ims, _ = gc.device_time(lambda: dk.kda_decode(*a, **attrs, in_place=True))
    anchors = {1: (4.08, 10.1), 64: (16.3, 22.4)}.get(B, (None, None))
    m = {"fused_us": ms * 1e3, "fused_in_place_us": ims * 1e3, "timing": how, "flashinfer_anchor_us": anchors[0],
         "triton_anchor_us": anchors[1], "state_TB/s": 2 * a[9][:B].numel() * 4 / ms / 1e9}
    if ctx.copy_tbps:
        m["frac_of_copy"] = m["state_TB/s"] / ctx.copy_tbps
    return gc.Result(f"kda fused decode B{B}-H96", "bench", None, m)


def bench_attn_res(ctx) -> list:
    gc = sys.modules[type(ctx).__module__]  # bench/gpu_check.py, run as __main__ or imported
    if not ctx.bench:
        return []
    import torch

    kern = imports()["attn_res"]

    out = []
    for R, N in ((8192, 8), (8192, 1)):
        d = 7168
        prefix = torch.randn(R, d, device="cuda", dtype=torch.bfloat16)
        bank = torch.randn(R, N, d, device="cuda", dtype=torch.bfloat16)
        nw, pw = torch.ones(d, device="cuda"), torch.randn(d, device="cuda") * 0.02
        if ctx.time_left() < 5:
            out.append(gc.Result(f"attn_res R{R}-N{N}", "info", None, note="skipped: section budget"))
            continue
        ms = gc._bench(lambda: kern.attn_res(prefix, bank, nw, pw, 1e-5), ctx)
        tbps = (N + 2) * R * d * 2 / ms / 1e9
        m = {"ms": ms, "TB/s": tbps}
        if ctx.copy_tbps:
            m["frac_of_copy"] = tbps / ctx.copy_tbps
        out.append(gc.Result(f"attn_res R{R}-N{N}-d{d}", "bench", None, m))
    return out


def moe_steps(kern, z, ids, wts, weights: dict, sm: int, activations: str | None = None) -> dict:
    """The plan's own steps for fixed routing (ids [N, k], weights [N, k] fp32): align once, then closures that
    run GEMM1, GEMM2 and everything after routing (align, both GEMMs, slot sum) with the plan's tiles and grids.
    `weights`: w1, w3, w2 (dense, for custom_ops/moe) or with w1_scale, w3_scale, w2_scale (MXFP4-packed, for
    custom_ops/moe_mxfp4, whose `activations` is "bf16" or "mxfp8")."""
    import torch

    from k3x.plan.dtypes import dtype_name
    from k3x.plan.launch import run

    (N, k), (E, I), L = ids.shape, weights["w1"].shape[:2], z.shape[1]
    d = {"N": N, "d": 16, "L": L, "E": E, "I": I}
    t = dtype_name(z.dtype)
    attrs = {"top_k": k, "activation": "situ", "situ_beta": 4.0, "situ_linear_beta": 25.0, "sm": sm}
    if activations is not None:
        attrs["activations"] = activations
    w_t = [dtype_name(w.dtype) for w in weights.values()]
    plan = kern.plan(d, [t, t, t, "fp32", *w_t, "int32", t], attrs)  # ports ..., weights, expert_offset, u
    names = [x.kernel_name for x in plan.select(d).launches]
    align, (g1,), (g2,), (sum_,) = ([n for n in names if part in n] for part in ("align", "gemm1", "gemm2", "sum"))
    env = weights | {"z": z, "ids": ids.reshape(-1).contiguous(), "wts": wts.reshape(-1).float().contiguous(),
                     "u": torch.empty_like(z)}
    env = run(plan, env, d, only=(*align, g1, g2))  # every buffer, once
    steps = {"gemm1": (g1,), "gemm2": (g2,), "experts": (*align, g1, g2, sum_)}
    return {name: (lambda only=only: run(plan, env, d, only=only)) for name, only in steps.items()} | {"env": env}


def grouped_mm_anchor(time_ms, z, ids, w1, w2) -> tuple[dict, str]:
    """torch._grouped_mm (bf16 grouped GEMM) on the routed rows of z [N, L] by ids [N, k] against the dense experts
    w1 [E, I, L] (gate and up: two calls of this size) and w2 [E, L, I]: ({metric: ms}, note why not, if not)."""
    import torch

    if not hasattr(torch, "_grouped_mm"):
        return {}, "torch._grouped_mm not available"
    k, E = ids.shape[1], w1.shape[0]
    try:
        order = ids.reshape(-1).argsort()
        a = z[(order // k)]  # [NK, L] rows grouped by expert
        offs = torch.bincount(ids.reshape(-1), minlength=E).cumsum(0).to(torch.int32)
        t_up = time_ms(lambda: torch._grouped_mm(a, w1.transpose(1, 2), offs=offs))  # one of gate/up
        a2 = torch.randn(a.shape[0], w1.shape[1], device=z.device, dtype=z.dtype)
        t_dn = time_ms(lambda: torch._grouped_mm(a2, w2.transpose(1, 2), offs=offs))
    except Exception as exc:  # noqa: BLE001 - an anchor that fails is reported, not fatal
        return {}, f"torch._grouped_mm failed: {type(exc).__name__}: {exc}"
    return {"grouped_mm_gate_up_ms": 2 * t_up, "grouped_mm_down_ms": t_dn}, ""


def bench_moe(ctx) -> list:
    gc = sys.modules[type(ctx).__module__]  # bench/gpu_check.py, run as __main__ or imported
    if not ctx.bench or ctx.time_left() < 20:
        return [] if not ctx.bench else [gc.Result("moe", "info", None, note="skipped: section budget")]
    import torch

    from k3x.plan.launch import device_sm

    kern = imports()["moe"]

    N, k, E, L, I = 8192, 16, 896, 3584, 3072  # K3: 131072 pairs over 896 experts (~146 rows each)
    dev, bf = "cuda", torch.bfloat16
    z = torch.randn(N, L, device=dev, dtype=bf)
    w1, w3 = (torch.empty(E, I, L, device=dev, dtype=bf).normal_(std=L ** -0.5) for _ in range(2))
    w2 = torch.empty(E, L, I, device=dev, dtype=bf).normal_(std=I ** -0.5)
    ids = torch.rand(N, E, device=dev).topk(k, dim=-1).indices  # ~uniform load
    wts = torch.rand(N, k, device=dev)
    steps = moe_steps(kern, z, ids, wts, {"w1": w1, "w3": w3, "w2": w2}, device_sm(z.device))
    NK = N * k
    m = {"gemm1_ms": gc._bench(steps["gemm1"], ctx), "gemm2_ms": gc._bench(steps["gemm2"], ctx),
         "experts_op_ms": gc._bench(steps["experts"], ctx)}
    m["gemm1_TFLOP/s"] = 2 * NK * L * 2 * I / m["gemm1_ms"] / 1e9
    m["gemm2_TFLOP/s"] = 2 * NK * I * L / m["gemm2_ms"] / 1e9
    m["gemms_TFLOP/s"] = 2 * NK * L * 3 * I / (m["gemm1_ms"] + m["gemm2_ms"]) / 1e9
    m["op_over_gemms"] = m["experts_op_ms"] / (m["gemm1_ms"] + m["gemm2_ms"])
    anchor, note = grouped_mm_anchor(lambda fn: gc._bench(fn, ctx), z, ids, w1, w2)
    m |= anchor
    if anchor:
        m["grouped_mm_TFLOP/s"] = 2 * NK * L * 3 * I / sum(anchor.values()) / 1e9
    return [gc.Result(f"moe experts N{N}-k{k}-E{E}-L{L}-I{I}", "bench", None, m, note)]


PROMPT, STEPS, WARMUP = 16, 32, 4  # decode graph section: tokens of the prompt, timed steps, untimed steps


def decode_graph_cases(base) -> list:
    """(tag, cache options) of the graph section on hybrid `base`: the static latent cache sized to the run
    (one shape per decode step: one graph captured, then replayed), and the growing cache (never replays)."""
    from k3x.model.options import CacheOptions

    capacity = PROMPT + WARMUP + STEPS
    return [(f"{base.name}-static-C{capacity}", CacheOptions(capacity)), (f"{base.name}-growing", CacheOptions())]


def decode_tokens(runners, runner, cfg, dtype, device: str, cache=None) -> tuple[float, object]:
    """(ms per timed decode step, greedy tokens [1, WARMUP + STEPS]) of `runner` from a PROMPT-token prefill."""
    import time

    import torch

    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    feeds = {n: t.to(device) for n, t in runners.start_feeds(cfg, torch.ones(1, PROMPT, dtype=torch.long),
                                                             dtype, cache).items()}
    o = runner.infer(feeds)
    toks, t0 = [], 0.0
    for i in range(STEPS + WARMUP):  # warm-up steps: Triton compiles, the graph is captured
        if i == WARMUP:
            sync()
            t0 = time.perf_counter()
        tok = o["logits"][:, -1:].argmax(-1)
        toks.append(tok)
        o = runner.infer(runners.next_feeds(cfg, o, tok, cache))
    sync()
    return (time.perf_counter() - t0) * 1e3 / STEPS, torch.cat(toks, -1).cpu()


def _graph_runners(m, ctx, cfg, model, cache):
    """(name, plain runner) pairs of one case: the pt2 program on CUDA, and with a static cache outside --quick
    an AOTInductor package compiled for CUDA (the aoti runner's graph path; compiling takes ~30-60 s)."""
    import tempfile
    from pathlib import Path

    ep = m["trace"].trace(model, cache=cache)
    yield "pt2", m["runners"].ModuleRunner("pt2", ep.module(), cfg, "cuda", cache)
    if not cache.static or ctx.quick or ctx.time_left() < 60:
        return
    from k3x.exporter.aoti import compile_aoti, load_aoti

    with tempfile.TemporaryDirectory() as tmp:
        package = compile_aoti(ep, Path(tmp) / "model.aoti.pt2")
        yield "aoti", m["runners"].ModuleRunner("aoti", load_aoti(package), cfg, "cuda", cache)


def bench_decode_graph(ctx) -> list:
    """Per-token decode latency (kernels=triton, bf16, B=1) on CUDA with and without CUDA graphs
    (runtime/cuda_graph.py), greedy tokens compared, for the cases of `decode_graph_cases` and the runners of
    `_graph_runners`; with the static cache the section also checks that one graph was captured and replayed
    every step."""
    gc = sys.modules[type(ctx).__module__]  # bench/gpu_check.py, run as __main__ or imported
    if not ctx.bench:
        return []
    import torch

    m = imports()
    out = []
    cfg = m["preset"]("k3-mini")
    for tag, cache in decode_graph_cases(cfg):
        if ctx.time_left() < 15:
            out.append(gc.Result(f"decode graph {tag}", "info", None, note="skipped: section budget"))
            continue
        model = m["build_model"](cfg, m["BuildOptions"](m["Kernels"].TRITON), device="cuda", dtype=torch.bfloat16,
                                 seed=0)
        for kind, plain in _graph_runners(m, ctx, cfg, model, cache):
            graphed, how = m["cuda_graph"].maybe_graphed(plain)
            res, tokens = {}, {}
            for name, runner in (("eager_launches", plain), ("cuda_graph", graphed)):
                res[f"{name}_ms_per_token"], tokens[name] = decode_tokens(m["runners"], runner, cfg, torch.bfloat16,
                                                                          "cuda", cache)
            res["speedup"] = res["eager_launches_ms_per_token"] / res["cuda_graph_ms_per_token"]
            stats = dict(getattr(graphed, "stats", {}))
            note, name = f"{how}; {stats}", f"decode graph {kind} {tag}"
            out.append(gc.Result(f"{name} B1", "bench", None, res, note))
            out.append(gc.Result(f"{name} same tokens", "parity",
                                 bool(torch.equal(tokens["eager_launches"], tokens["cuda_graph"])), note=note))
            if cache.static:  # the point of the static cache: decode steps replay one graph
                out.append(gc.Result(f"{name} replayed", "parity",
                                     stats.get("captured") == 1 and stats.get("replayed", 0) >= STEPS, note=note))
            del plain, graphed
        del model
    return out


BENCHMARKS = [bench_ceilings, bench_kda, bench_attn_res, bench_moe, bench_decode_graph]
