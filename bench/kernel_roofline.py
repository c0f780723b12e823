"""Roofline estimates of one op call at a kernel_resources case: FLOPs and bytes against a GPU's peaks.

`estimate(family, dims, attrs, gpu)` -> FLOPs (GFLOP), compulsory bytes (MB: every input read once, every
output written once; the plan's own workspace traffic is not counted, so the floor is the op's, whatever
kernels run), arithmetic intensity, which ceiling binds and the floor time (µs) on `gpu`. The figures are
estimates for comparison with measured device times (bench/gpu_check.py), not measurements.

FLOPs, counted as 2 per multiply-add:
- KDA chunked (64-token chunks; docs/model.md §2.4): per token and head 6·K·V (W·S, q·S, the state update) +
  BT·(4K + 2K + 4V) (the in-chunk scores, W and U, A·V'); recurrent: 7·K·V per token and head.
- MoE: router 2·N·d·E, experts 2·N·k·3·L·I; bytes: the experts the N·k pairs reach (uniform routing,
  E·(1 − (1 − k/E)^N)) in their storage format (bf16, or MXFP4 with one E8M0 scale per 32).
- MLA absorbed attention: per query row, head and visible key 2·(C+R) for the score and 2·C for P·V; bytes:
  each sequence's past latents once (bf16), the queries, this step's latents and o.
- AttnRes, kda_prep, kda_decode: memory-bound (their FLOPs are a few per byte).
Peaks (dense, no sparsity): H100 SXM 989 TFLOP/s bf16, 1979 fp8, 3.35 TB/s; H200 the same compute, 4.8 TB/s;
B200 2250 bf16, 4500 fp8, 8 TB/s.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Peak:
    name: str
    bf16_tflops: float
    fp8_tflops: float
    tbps: float


PEAKS = {"H100": Peak("H100 SXM", 989.0, 1979.0, 3.35), "H200": Peak("H200", 989.0, 1979.0, 4.8),
         "B200": Peak("B200", 2250.0, 4500.0, 8.0)}
GPUS_OF_SM = {90: ("H100", "H200"), 100: ("B200",)}
BT = 64  # KDA chunk


def _kda(tokens: int, states: int, H: int, K: int, V: int, chunked: bool) -> tuple[float, float]:
    per = 6 * K * V + BT * (6 * K + 4 * V) if chunked else 7 * K * V
    io = tokens * H * (2 * K * 2 + V * 2 + K * 4 + 4 + V * 2)  # q, k, v bf16; g, beta fp32; o bf16
    return tokens * H * per, io + 2 * states * H * K * V * 4  # the fp32 state read and written


def _moe(N: int, d: int, L: int, I: int, E: int, k: int, weight_bytes: float) -> tuple[float, float]:
    reached = E * (1 - (1 - k / E) ** N)
    return 2 * N * d * E + 2 * N * k * 3 * L * I, reached * 3 * L * I * weight_bytes + N * (d + 2 * L) * 2 + E * d * 2


def op_cost(family: str, d: dict, attrs: dict) -> tuple[float, float]:
    """(FLOPs, compulsory bytes) of one call of `family` at dims `d`."""
    if family == "kda":
        return _kda(d["B"] * d["T"], d["B"], d["H"], d["K"], d["V"], d["T"] > 16)
    if family == "kda_packed":
        return _kda(d["N"], d["B"], d["H"], d["K"], d["V"], d["N"] > d["B"])
    if family == "kda_decode":
        B, H, K, V, W = d["B"], d["H"], d["K"], d["V"], d["W"]
        C = 2 * H * K + H * V
        return B * H * 7 * K * V, 2 * B * H * K * V * 4 + 2 * B * C * (W - 1) * 4 + B * (C + H * K + H + 2 * H * V) * 2
    if family == "kda_prep":
        N, B, H, K, V, W = d["N"], d["B"], d["H"], d["K"], d["V"], d["W"]
        C = 2 * H * K + H * V
        return 2 * N * C * W, N * (C + H * K + H) * 2 + 2 * B * C * (W - 1) * 4 + N * H * ((2 * K + V) * 2 + K * 4 + 4)
    if family == "attn_res":
        R, S, dd = d["R"], d["N"], d["d"]
        return 6 * R * S * dd, (R * dd * 2) * (S + 2)
    if family in ("moe", "moe_mxfp4"):
        w = 2.0 if family == "moe" else 0.5 + 1 / 32
        return _moe(d["N"], d["d"], d["L"], d["I"], d["E"], attrs.get("top_k", 16), w)
    if family == "mla_paged":
        N, B, H, C, R, past = d["N"], d["B"], d["H"], d["C"], d["R"], d["past"]
        rows = N // B
        keys = B * rows * (past + (rows + 1) / 2)  # visible keys summed over query rows (causal within the step)
        return keys * H * (2 * (C + R) + 2 * C), (B * past + N) * (C + R) * 2 + N * H * (2 * C + R) * 2
    raise KeyError(family)


def estimate(family: str, d: dict, attrs: dict, gpu: str) -> dict:
    """The roofline figures of one call on `gpu` (a key of PEAKS)."""
    flops, nbytes = op_cost(family, d, attrs)
    p = PEAKS[gpu]
    fp8 = attrs.get("activations") == "mxfp8"
    t_math = flops / ((p.fp8_tflops if fp8 else p.bf16_tflops) * 1e12) * 1e6
    t_mem = nbytes / (p.tbps * 1e12) * 1e6
    return {"GFLOP": round(flops / 1e9, 3), "MB": round(nbytes / 1e6, 2), "flop_per_byte": round(flops / nbytes, 1),
            f"bound_{gpu}": "compute" if t_math > t_mem else "memory", f"floor_us_{gpu}": round(max(t_math, t_mem), 2)}


def estimates(family: str, d: dict, attrs: dict, sm: int) -> dict:
    """`estimate` on every GPU of an SM generation, merged (GFLOP, MB and intensity once)."""
    out: dict = {}
    for gpu in GPUS_OF_SM.get(sm, ()):
        out |= estimate(family, d, attrs, gpu)
    return out
