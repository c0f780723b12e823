"""The k3::KDA CPU kernel (custom_ops/kda/ort_kernel.cc, the batch interface's recurrence on
custom_ops/kda/ort_recurrence.h): a bare KDA node (no function body beside it, so the kernel ran) against the
reference's recurrence in fp64, at awkward sizes; decode rows chained one step at a time equal one call over
the same rows; a bad input named; and a KDA layer's export running its recurrence on the kernel."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ort_kernel_models import bare, session


def _model(scale: float):
    return bare("KDA", ("q", "k", "v", "g", "beta", "initial_state"), ["o", "final_state"], scale=scale)


def _inputs(B: int, T: int, H: int, K: int, V: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    unit = lambda *s: torch.nn.functional.normalize(torch.randn(*s, generator=g), dim=-1)  # noqa: E731
    return {"q": unit(B, T, H, K), "k": unit(B, T, H, K), "v": torch.randn(B, T, H, V, generator=g),
            "g": -5 * torch.rand(B, T, H, K, generator=g), "beta": torch.rand(B, T, H, generator=g),
            "initial_state": torch.randn(B, H, K, V, generator=g)}


@pytest.mark.parametrize("B,T,H,K,V", [
    (1, 1, 8, 128, 128),  # a K3 decode step: full column blocks, the one-row path
    (3, 1, 2, 16, 40),  # decode rows over a full block and a partial one
    (2, 5, 3, 7, 5),  # odd head sizes, a few rows
    (1, 70, 2, 32, 24),  # a prefill longer than the reference's 64-row chunk
    (2, 0, 2, 8, 8),  # no rows: the state is passed on
])
def test_kda_kernel_matches_the_reference(kernels, B, T, H, K, V):
    from k3x.custom_ops.kda.reference import kda_recurrent

    x = _inputs(B, T, H, K, V, seed=B * 100 + T * 10 + K)
    scale = K ** -0.5
    o, final = session(_model(scale), kernels).run(None, {n: t.numpy() for n, t in x.items()})
    want_o, want_s = kda_recurrent(*(x[n].double() for n in ("q", "k", "v", "g", "beta")), scale=scale,
                                   initial_state=x["initial_state"].double())
    assert o.shape == (B, T, H, V) and final.shape == (B, H, K, V)
    np.testing.assert_allclose(o, want_o.numpy(), rtol=1e-4, atol=1e-4, err_msg="o")
    np.testing.assert_allclose(final, want_s.numpy(), rtol=1e-4, atol=1e-4, err_msg="final_state")


def test_kda_kernel_decode_steps_equal_one_call_over_the_rows(kernels):
    """Three one-row calls, each from the last one's state, give one three-row call's outputs and state (the
    batch interface's decode against its prefill): the rows are independent of how they are split in calls."""
    B, T, H, K, V = 2, 3, 2, 128, 128
    x = {n: t.numpy() for n, t in _inputs(B, T, H, K, V, seed=7).items()}
    run = session(_model(K ** -0.5), kernels).run
    o, final = run(None, x)
    state = x["initial_state"]
    for t in range(T):
        rows = {n: x[n][:, t: t + 1] for n in ("q", "k", "v", "g", "beta")}
        step_o, state = run(None, {**rows, "initial_state": state})
        np.testing.assert_allclose(step_o[:, 0], o[:, t], rtol=1e-6, atol=1e-6, err_msg=f"row {t}")
    np.testing.assert_allclose(state, final, rtol=1e-6, atol=1e-6)


def test_kda_kernel_names_the_bad_input(kernels):
    feeds = {n: t.numpy() for n, t in _inputs(2, 3, 2, 16, 16, seed=0).items()}
    feeds["initial_state"] = np.zeros((2, 2, 16, 15), np.float32)
    with pytest.raises(Exception, match=r"k3::KDA: initial_state \[2, 2, 16, 15\]: expected \[B, H, K, V\] = "
                                        r"\[2, 2, 16, 16\]"):
        session(_model(0.25), kernels).run(None, feeds)
