"""The one tolerance table, keyed by dtype (or by a CPU trunk): (atol, rtol) for comparing against an fp32
reference.

Used by the parity harness (runtime/verify.py: an export against its own model, keyed by the export's dtype; a
CPU trunk export's own model holds the same trunk, and an int8 trunk has a key of its own: `parity_key`) and by
the tests (tests/tolerances.py re-exports it; the
trunk keys state what a trunk costs against the fp32 model: tests/exporter/test_trunk_export.py).
A value passes when |actual - expected| <= atol + rtol * |expected| (torch.allclose).
"""

from __future__ import annotations

import torch

Tolerance = torch.dtype | str  # a key of TOLERANCES: a dtype, or a named key (the CPU trunks)

TOLERANCES: dict[Tolerance, tuple[float, float]] = {
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
    # its own trunk model: bf16 at fp32's tolerance, int8 at the key below). Each projection's weights are rounded (bf16: 2^-9 relative;
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
    # An int8-trunk export against its own model (`k3x verify`): both quantise each projection's activations to
    # int8 per block of 32 at run time (MatMulNBits, accuracy_level 4), a step function of its input. A 1-ulp
    # difference upstream (a kernel's summation order against torch's) puts an activation on the other side of a
    # code boundary now and then, and that projection's output moves by one code (the block's absmax / 127) times
    # the weights. Measured on k3-mini with routing fixed (tests/trunk_models.py), batch 3 prompt 7: one such flip
    # behind a shared expert's down projection, the kernel library's path against the function bodies, gave
    # logits max-abs 0.045 and latent state 0.019; everywhere else the two agree to 2e-6.
    "int8 trunk, own model": (1e-1, 2e-2),
}


def parity_key(dtype: torch.dtype, trunk: str) -> Tolerance:
    """The tolerance an export of `dtype` with `trunk` (model/options.BuildOptions.trunk) is held to against its
    own model: its dtype's, or the int8 trunk's own key."""
    return "int8 trunk, own model" if trunk == "int8" else dtype


def tol(dtype: Tolerance) -> dict[str, float]:
    """(atol, rtol) of a dtype or of a named key (the trunks)."""
    try:
        atol, rtol = TOLERANCES[dtype]
    except KeyError:
        raise ValueError(f"no tolerance for dtype {dtype}; known: {list(TOLERANCES)}") from None
    return {"atol": atol, "rtol": rtol}
