"""Every dispatch candidate (custom_ops/<family>/candidates.py) against the reference before it may be picked:
the project's kernels and launch entries (KDA's state kernel, AttnRes' tiles), fla-core's KDA kernels,
torch._grouped_mm experts.

Under the interpreter (fp32, tiny shapes) every candidate runs except fla's `chunk_kda`, whose intra kernel
calls a helper the interpreter cannot run (it needs a GPU: bench/gpu_check.py's tune section checks it there,
with every other candidate, before timing it). A candidate whose package is absent is skipped, with that reason.
"""

from __future__ import annotations

import pytest
import torch

from k3x.custom_ops.attn_res import candidates as attn
from k3x.custom_ops.attn_res import reference as attn_ref
from k3x.custom_ops.kda import candidates as kda
from k3x.custom_ops.kda import reference as kda_ref
from k3x.custom_ops.kda_packed import candidates as packed
from k3x.custom_ops.kda_packed import reference as packed_ref
from k3x.custom_ops.moe import candidates as moe
from k3x.custom_ops.moe import reference as moe_ref
from tolerances import assert_close

def _runnable(op: str, c, device: str) -> None:
    if c.missing():
        pytest.skip(c.missing())
    if device == "cpu" and not c.interprets:
        pytest.skip(f"{op} {c.name} does not run under the interpreter")


V_TEST = 32  # the value width of the KDA cases: state entries of BV >= 32 run as BV = 32 here


def _kda_cases():
    """(op, T, candidate name) for every candidate; under the interpreter (where warps and stages are ignored) one
    state-kernel entry per distinct block width at V_TEST, the rest being the same program there."""
    import os

    interpreted, seen, out = os.environ.get("TRITON_INTERPRET") == "1", set(), []
    for op, cands in kda.CANDIDATES.items():
        for c in cands:
            width = c.name.split("-")[2].split("x")[0] if c.name.startswith("k3x-state-") else c.name
            if width.isdigit():
                if interpreted and min(int(width), V_TEST) in seen:
                    continue
                seen.add(min(int(width), V_TEST))
            steps = (70,) if op == kda.PREFILL else (1, 3)
            out += [pytest.param(op, T, c.name, id=f"{op}-T{T}-{c.name}") for T in steps]
    return out


@pytest.mark.parametrize("op, T, name", _kda_cases())
def test_kda_candidate_matches_reference(op, T, name, device):
    cand = {c.name: c for c in kda.CANDIDATES[op]}[name]
    _runnable(op, cand, device)
    torch.manual_seed(0)
    B, H, K, V = 2, 2, 16, V_TEST
    q, k = (kda_ref.l2norm(torch.randn(B, T, H, K, device=device)) for _ in range(2))
    v = torch.randn(B, T, H, V, device=device)
    g = torch.rand(B, T, H, K, device=device) * -5.0
    beta = torch.rand(B, T, H, device=device)
    h0 = torch.randn(B, H, K, V, device=device) * 0.1
    o, s = cand.run(q, k, v, g, beta, K ** -0.5, h0, -5.0)
    ro, rs = kda_ref.kda_recurrent(q, k, v, g, beta, scale=K ** -0.5, initial_state=h0)
    assert o.dtype == v.dtype and s.dtype == torch.float32
    assert_close(o, ro, torch.float32, what=f"{op} {name}: o")
    assert_close(s, rs, torch.float32, what=f"{op} {name}: final state")


@pytest.mark.parametrize("name", [c.name for c in moe.CANDIDATES])
@pytest.mark.parametrize("offset", [None, 2])
def test_moe_candidate_matches_reference(name, offset, device):
    """Whole op and an expert-parallel rank (experts 2..5 of 8 local: pairs routed elsewhere left out)."""
    cand = {c.name: c for c in moe.CANDIDATES}[name]
    _runnable(moe.EXPERTS, cand, device)
    torch.manual_seed(0)
    N, d, L, I, EG, k = 9, 24, 16, 24, 8, 3
    E = EG if offset is None else 4
    x, z = torch.randn(N, d, device=device), torch.randn(N, L, device=device)
    gw, gb = torch.randn(EG, d, device=device) * d ** -0.5, torch.randn(EG, device=device) * 0.1
    w1, w3 = (torch.randn(E, I, L, device=device) * L ** -0.5 for _ in range(2))
    w2 = torch.randn(E, L, I, device=device) * I ** -0.5
    off = None if offset is None else torch.tensor([offset], dtype=torch.int32, device=device)
    args = (x, z, gw, gb, w1, w3, w2, k, 1.0, True, "situ", 4.0, 25.0, off)
    assert_close(cand.run(*args), moe_ref.moe(*args), torch.float32, what=f"moe {name} offset {offset}")


def _attn_cases():
    """Every launch entry on the GPU; under the interpreter (one tile at these sizes, warps ignored) two."""
    import os

    names = [c.name for c in attn.CANDIDATES]
    return names[:2] if os.environ.get("TRITON_INTERPRET") == "1" else names


@pytest.mark.parametrize("name", _attn_cases())
def test_attn_res_candidate_matches_reference(name, device):
    cand = {c.name: c for c in attn.CANDIDATES}[name]
    _runnable(attn.MIX, cand, device)
    torch.manual_seed(0)
    R, N, d = 3, 8, 100
    prefix, bank = torch.randn(R, d, device=device) * 4, torch.randn(R, N, d, device=device)
    nw, pw = 1 + 0.1 * torch.randn(d, device=device), torch.randn(d, device=device) * 0.05
    assert_close(cand.run(prefix, bank, nw, pw, 1e-5), attn_ref.attn_res(prefix, bank, nw, pw, 1e-5), torch.float32,
                 what=f"attn_res {name}")


@pytest.mark.parametrize("lens, which", [([1, 1, 1], "short"), ([1, 3, 2], "short"), ([1, 40, 2], "mixed")])
def test_kda_packed_candidates_match_reference(lens, which, device):
    """Every candidate of the step's class: decode-like steps (no sequence past RECURRENT_MAX_T) and a step with
    a prefill chunk, pool rows picked out of order."""
    torch.manual_seed(0)
    H, K, V, N, B = 2, 16, 32, sum(lens), len(lens)
    q, k = (kda_ref.l2norm(torch.randn(N, H, K, device=device)) for _ in range(2))
    v, g = torch.randn(N, H, V, device=device), torch.rand(N, H, K, device=device) * -5.0
    beta, pool = torch.rand(N, H, device=device), torch.randn(B + 2, H, K, V, device=device) * 0.3
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
    slots = torch.tensor([B + 1, 0, 2][:B], dtype=torch.int32, device=device)
    assert packed.short(N, B) == (which == "short")
    want = packed_ref.kda_packed(q, k, v, g, beta, pool, cu, slots, scale=K ** -0.5)
    for cand in packed.SHORT if which == "short" else packed.MIXED:
        if cand.missing() or (device == "cpu" and not cand.interprets):
            continue
        o, s = cand.run(q, k, v, g, beta, pool, cu, slots, K ** -0.5, -5.0)
        assert_close(o, want[0], torch.float32, what=f"kda_packed {cand.name} {lens}: o")
        assert_close(s, want[1], torch.float32, what=f"kda_packed {cand.name} {lens}: final state")
