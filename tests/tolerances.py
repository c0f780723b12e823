"""The one tolerance table, keyed by dtype: (atol, rtol) for comparing against an fp32/fp64 oracle."""

from __future__ import annotations

import torch

TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float64: (1e-10, 1e-8),
    torch.float32: (2e-5, 2e-4),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (2e-2, 2e-2),
}


def tol(dtype: torch.dtype) -> dict[str, float]:
    atol, rtol = TOLERANCES[dtype]
    return {"atol": atol, "rtol": rtol}


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype | None = None, what: str = "") -> None:
    """Shape and dtype first, then values, with max-abs and RMSE-ratio in the message."""
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    a, e = actual.double(), expected.double()
    assert torch.isfinite(a).all(), f"{what}: non-finite values"
    err = (a - e).abs().max().item()
    rmse_ratio = ((a - e).pow(2).mean().sqrt() / (e.pow(2).mean().sqrt() + 1e-12)).item()
    torch.testing.assert_close(a, e, **tol(dtype or actual.dtype),
                               msg=lambda m: f"{what}: max_abs={err:.3g} rmse_ratio={rmse_ratio:.3g}\n{m}")
