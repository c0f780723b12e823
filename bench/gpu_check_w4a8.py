"""W4A8 sections of bench/gpu_check.py: K3's deployment numerics (MXFP4 experts × MXFP8 activations).

- `parity_moe_w4a8`: k3::moe_mxfp4's Triton plan with activations="mxfp8" (sm_90: e4m3 wgmma with the E8M0
  scales applied per 32-wide k step; sm_100+: tl.dot_scaled on both block-scaled operands) against the fp32
  reference that emulates the same MXFP8 rounding, at decode (swap-AB tiles) and prefill (plain tiles) shapes,
  within the tolerance table's float8_e4m3fn entry (runtime/tolerances.py says why it is that wide); it must also
  sit clearly closer to that oracle than to the bf16-activation one (the quantization really happened). The
  bf16-activation packed path is checked beside it (the bf16 entry). Runs in the CPU self-test too (fp32,
  interpreter, sm_90's FP8 path), where the fp32 entry applies.
- `bench_moe_w4a8`: the two expert GEMMs of the plan at K3's expert shape (E 896, L 3584, I 3072, top-16) for
  decode batches of 1, 16 and 64 tokens and a 4096-token prefill: W4A8 beside the bf16-activation MXFP4 GEMMs
  and the bf16 grouped-GEMM anchor (torch._grouped_mm on dense bf16 experts), all in one run, as device time
  (a CUDA graph of as many launches as fill ~25 ms, `gpu_check_timing.device_time_within`).
Helpers (Result, _compare, device_time_within) come from the running gpu_check module; moe_steps and
grouped_mm_anchor from gpu_check_bench.
"""

from __future__ import annotations

import math
import sys

K3_EXPERTS = {"E": 896, "L": 3584, "I": 3072, "k": 16}
DECODE_TOKENS, PREFILL_TOKENS = (1, 16, 64), 4096


def packed_experts(E: int, I: int, L: int, device, gen=None) -> dict:
    """Random MXFP4 experts (every code; scale bytes around 2^-log2(2.93·sqrt(K)), 2.93 the rms of a random
    E2M1 code, so each GEMM's outputs are O(1)): w1, w3 [E, I, L/2], w2 [E, L, I/2] u8 and their E8M0 scales."""
    import torch

    def codes(*s):
        return torch.randint(0, 256, s, generator=gen, dtype=torch.uint8, device=device)

    def scales(*s, K):
        b = 127 - round(math.log2(2.93 * math.sqrt(K)))
        return torch.randint(b - 1, b + 2, s, generator=gen, dtype=torch.uint8, device=device)

    return {"w1": codes(E, I, L // 2), "w3": codes(E, I, L // 2), "w2": codes(E, L, I // 2),
            "w1_scale": scales(E, I, L // 32, K=L), "w3_scale": scales(E, I, L // 32, K=L),
            "w2_scale": scales(E, L, I // 32, K=I)}


def parity_cases(selftest: bool) -> list[tuple]:
    """(phase, N, d, L, I, E, k): decode blocks of 16 rows (swap-AB), prefill blocks of 64 (plain tiles). On the
    GPU, top-16 and widths whose tiles are K3's (L, I >= 64 · 2, multiples of 16): `bench_moe_w4a8` then reuses
    the kernels this section compiled."""
    if selftest:
        return [("decode", 2, 16, 64, 32, 6, 2), ("prefill", 96, 16, 64, 32, 3, 2)]
    return [("decode", 1, 512, 512, 384, 896, 16), ("decode", 64, 512, 512, 384, 896, 16),
            ("prefill", 512, 512, 512, 384, 128, 16)]


def parity_moe_w4a8(ctx) -> list:
    gc = sys.modules[type(ctx).__module__]  # bench/gpu_check.py, run as __main__ or imported
    import torch

    from k3x.custom_ops.moe_mxfp4 import reference as ref
    from k3x.custom_ops.moe_mxfp4 import triton as kern

    tol8 = torch.float8_e4m3fn if ctx.device == "cuda" else ctx.dtype  # fp32 interpreter: exact products
    out = []
    for phase, N, d, L, I, E, k in parity_cases(ctx.selftest):
        tag = f"{phase} N{N}-L{L}-I{I}-E{E}-k{k}"
        if ctx.time_left() < 3:
            out.append(gc.Result(f"moe_w4a8 u {tag}", "info", None, note="skipped: section budget"))
            continue
        dev = ctx.device
        x, z = (torch.randn(N, n, device=dev).to(ctx.dtype) for n in (d, L))
        gw, gb = (torch.randn(E, d, device=dev) * d ** -0.5).to(ctx.dtype), torch.randn(E, device=dev) * 0.1
        w = packed_experts(E, I, L, dev)
        args = (x, z, gw, gb, *w.values(), k, 1.0, True, "situ", 4.0, 25.0)
        up = (x.float(), z.float(), gw.float(), gb, *w.values(), *args[10:])
        want8, want16 = ref.moe(*up, activations="mxfp8"), ref.moe(*up)
        got8 = kern.moe(*args, activations="mxfp8")
        off16 = ((got8.double() - want16.double()).pow(2).mean().sqrt() / want8.double().pow(2).mean().sqrt()).item()
        r = gc._compare(f"moe_w4a8 u {tag}", got8, want8, tol8, {"rmse_ratio_vs_bf16_activations": off16})
        if r.metrics["rmse_ratio"] >= 0.5 * off16:  # as close to the unquantized oracle: MXFP8 did not happen
            r.ok, r.note = False, (r.note + " no closer to the MXFP8 oracle than to the bf16-activation one").strip()
        out += [r, gc._compare(f"moe_w4a16 u {tag}", kern.moe(*args), want16, ctx.dtype)]
    return out


def bench_moe_w4a8(ctx) -> list:
    """Per token count: GEMM1 (gate+up) and GEMM2 (down) of the W4A8 and the bf16-activation MXFP4 plans, and the
    grouped-GEMM anchor, in µs; the packed weights' bytes over the time of both GEMMs (decode is weight-bound)."""
    gc = sys.modules[type(ctx).__module__]  # bench/gpu_check.py, run as __main__ or imported
    if not ctx.bench:
        return []
    import torch

    import gpu_check_bench as gb  # bench/, beside this file

    from k3x.plan.launch import device_sm

    kern = gb.imports()["moe_mxfp4"]
    E, L, I, k = (K3_EXPERTS[n] for n in ("E", "L", "I", "k"))
    dev, bf = "cuda", torch.bfloat16
    packed = packed_experts(E, I, L, dev)
    w1 = torch.empty(E, I, L, device=dev, dtype=bf).normal_(std=L ** -0.5)  # the anchor's dense experts (gate = up)
    w2 = torch.empty(E, L, I, device=dev, dtype=bf).normal_(std=I ** -0.5)
    timed = lambda fn: gc.device_time_within(fn)[0]  # noqa: E731
    out, sm = [], device_sm(dev)
    tokens = (1, 64, PREFILL_TOKENS) if ctx.quick else (*DECODE_TOKENS, PREFILL_TOKENS)
    for N in tokens:
        name = f"moe w4a8 {'prefill' if N == PREFILL_TOKENS else 'decode'} N{N}-k{k}-E{E}-L{L}-I{I}"
        if ctx.time_left() < 8:
            out.append(gc.Result(name, "info", None, note="skipped: section budget"))
            continue
        z = torch.randn(N, L, device=dev, dtype=bf)
        ids = torch.rand(N, E, device=dev).topk(k, dim=-1).indices  # ~uniform load
        wts = torch.rand(N, k, device=dev)
        m = {}
        for fmt in ("mxfp8", "bf16"):
            steps = gb.moe_steps(kern, z, ids, wts, packed, sm, fmt)
            for g in ("gemm1", "gemm2"):
                m[f"{'w4a8' if fmt == 'mxfp8' else 'w4a16'}_{g}_us"] = timed(steps[g]) * 1e3
            del steps
        anchor, note = gb.grouped_mm_anchor(timed, z, ids, w1, w2)
        m |= {key.replace("_ms", "_us"): v * 1e3 for key, v in anchor.items()}
        out.append(gc.Result(name, "bench", None, m | figures(m, ids, E, L, I, ctx.copy_tbps), note))
    return out


def figures(m: dict, ids, E: int, L: int, I: int, copy_tbps: float | None) -> dict:
    """Derived figures of one row: experts touched, rows per touched expert, the W4A8 GEMMs' packed-weight
    bandwidth (and its fraction of the copy ceiling), TFLOP/s, and speedups over the other two."""
    import torch

    touched = int(torch.unique(ids).numel())
    w4a8_us = m["w4a8_gemm1_us"] + m["w4a8_gemm2_us"]
    weight_bytes = touched * 3 * I * L * (0.5 + 1 / 32)  # codes and scale bytes of the touched experts
    f = {"experts_touched": touched, "rows_per_expert": ids.numel() / touched,
         "w4a8_weight_TB/s": weight_bytes / w4a8_us / 1e6, "w4a8_TFLOP/s": 2 * ids.numel() * L * 3 * I / w4a8_us / 1e6,
         "w4a8_speedup_vs_w4a16": (m["w4a16_gemm1_us"] + m["w4a16_gemm2_us"]) / w4a8_us}
    if "grouped_mm_down_us" in m:
        f["w4a8_speedup_vs_bf16_grouped_mm"] = (m["grouped_mm_gate_up_us"] + m["grouped_mm_down_us"]) / w4a8_us
    if copy_tbps:
        f["w4a8_frac_of_copy"] = f["w4a8_weight_TB/s"] / copy_tbps
    return f
