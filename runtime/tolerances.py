"""The one tolerance table, keyed by dtype (or by a CPU trunk): (atol, rtol) for comparing against an fp32
reference.

Used by the parity harness (runtime/verify.py: an export against its own model, keyed by the export's dtype; a
CPU trunk export's own model holds the same trunk) and by the tests (tests/tolerances.py re-exports it; the
trunk keys state what a trunk costs against the fp32 model: tests/exporter/test_trunk_export.py).
A value passes when |actual - expected| <= atol + rtol * |expected| (torch.allclose).
"""

from __future__ import annotations

import torch

TOLERANCES: dict[torch.dtype | str, tuple[float, float]] = {
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
    # A CPU trunk's model (model/trunk.py: the dense projections on bf16 / 8-bit weights, fp32 activations) against
    # the fp32 model, logits and every state tensor: what the format costs (`k3x verify` holds a trunk export to
    # its own trunk model at fp32's tolerance). Each projection's weights are rounded (bf16: 2^-9 relative;
    # int8: absmax / 254 per block of 32) and, in the int8 trunk, the activations to int8 per block too (as ONNX
    # Runtime's MatMulNBits at accuracy_level 4 does); the errors add up through the layers and the recurrent state.
    # Measured on k3-mini (random weights, routing fixed by the router bias so that no expert choice flips;
    # tests/exporter/test_trunk_export.py: 4 prompts of 7, 16 decode steps each): logits of max ~4 within
    # max-abs 0.07 (bf16) and 0.78 (int8), the KDA and latent state within 0.05 and 0.18 (k3x verify's 8 steps).
    # The int8 trunk rounds each weight by ~0.5 % rms (bf16: ~0.1 %) and each activation block as much again; a
    # random network amplifies a weight's rounding ~15x by the logits, and more with every recurrent step. A
    # router tie within the error flips an expert choice and fails the comparison (docs/model.md "CPU trunks").
    "bf16 trunk": (1e-1, 5e-2),
    "int8 trunk": (1.0, 1e-1),
}


def tol(dtype: torch.dtype | str) -> dict[str, float]:
    try:
        atol, rtol = TOLERANCES[dtype]
    except KeyError:
        raise ValueError(f"no tolerance for dtype {dtype}; known: {list(TOLERANCES)}") from None
    return {"atol": atol, "rtol": rtol}
