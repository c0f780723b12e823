"""Test helpers over the one tolerance table, which lives in the package (k3x/runtime/tolerances.py) so
the parity harness and the tests share it: (atol, rtol) keyed by dtype, against an fp32/fp64 oracle."""

from __future__ import annotations

import torch

from k3x.runtime.tolerances import TOLERANCES, tol  # noqa: F401  (re-exported for tests)


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype | None = None, what: str = "",
                 scaled: bool = False) -> None:
    """Shape first, then values, with max-abs and RMSE-ratio in the message. Dtypes may differ (oracles run
    in fp32/fp64); the tolerance is `dtype`'s, else the actual tensor's. The table's atol assumes values of
    order 1; `scaled` multiplies it by the expected tensor's rms where that is larger (logits of a model whose
    head is tied to its embedding are of order 10: rounding in their sums is of that order too)."""
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    a, e = actual.double(), expected.double()
    assert torch.isfinite(a).all(), f"{what}: non-finite values"
    err = (a - e).abs().max().item()
    rmse_ratio = ((a - e).pow(2).mean().sqrt() / (e.pow(2).mean().sqrt() + 1e-12)).item()
    tolerance = tol(dtype or actual.dtype)
    if scaled:
        tolerance["atol"] *= max(1.0, e.pow(2).mean().sqrt().item())
    torch.testing.assert_close(a, e, **tolerance,
                               msg=lambda m: f"{what}: max_abs={err:.3g} rmse_ratio={rmse_ratio:.3g}\n{m}")
