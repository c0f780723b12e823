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
}


def tol(dtype: torch.dtype) -> dict[str, float]:
    try:
        atol, rtol = TOLERANCES[dtype]
    except KeyError:
        raise ValueError(f"no tolerance for dtype {dtype}; known: {list(TOLERANCES)}") from None
    return {"atol": atol, "rtol": rtol}
