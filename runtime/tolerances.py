"""The one tolerance table, keyed by dtype: (atol, rtol) for comparing against an fp32 reference.

Used by the parity harness (runtime/verify.py) and by the tests (tests/tolerances.py re-exports it).
A value passes when |actual - expected| <= atol + rtol * |expected| (torch.allclose).
"""

from __future__ import annotations

import torch

TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float64: (1e-10, 1e-8),
    torch.float32: (2e-5, 2e-4),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (2e-2, 2e-2),
    # GEMMs on E4M3 operands with bf16 storage (W4A8 MoE: MXFP8 activations x MXFP4 experts on a GPU) against the
    # fp32 oracle that emulates the same MXFP8 rounding. The kernel stores the GLU output h in bf16 before GEMM2
    # re-quantizes it: a bf16 rounding (2^-9) moves an element across an E4M3 rounding boundary (3 mantissa bits)
    # now and then, and that element is then one E4M3 step (2^-4 .. 2^-3 relative) off the oracle's. On top, Hopper's
    # FP8 MMA (wgmma e4m3) accumulates with reduced internal precision (products aligned to the largest, ~13-14 bits
    # kept), small here because each MMA is one 32-wide scale block added into fp32 outside it. An emulation of the
    # first effect at O(1) outputs gives rms 1.7 % of the output's rms and max-abs 0.05 (bench/gpu_check_w4a8.py).
    torch.float8_e4m3fn: (1e-1, 5e-2),
}


def tol(dtype: torch.dtype) -> dict[str, float]:
    try:
        atol, rtol = TOLERANCES[dtype]
    except KeyError:
        raise ValueError(f"no tolerance for dtype {dtype}; known: {list(TOLERANCES)}") from None
    return {"atol": atol, "rtol": rtol}
