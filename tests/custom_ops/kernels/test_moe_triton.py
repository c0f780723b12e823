"""MoE Triton kernels (routing, alignment, grouped GEMMs with fused GLU, un-permute) vs the fp32 reference."""

from __future__ import annotations

import pytest
import torch

from k3x.custom_ops.moe import reference
from k3x.custom_ops.moe import triton as kernels
from tolerances import assert_close


def _inputs(N, d, L, I, E, *, hot=None, dtype=torch.float32, device="cpu"):
    x = torch.randn(N, d, device=device)
    z = torch.randn(N, L, device=device)
    gate_weight = torch.randn(E, d, device=device) * d ** -0.5
    gate_bias = torch.randn(E, device=device) * 0.1
    if hot is not None:  # every token picks this expert first
        gate_bias[hot] = 100.0
    w1, w3 = (torch.randn(E, I, L, device=device) * L ** -0.5 for _ in range(2))
    w2 = torch.randn(E, L, I, device=device) * I ** -0.5
    return [t.to(dtype) for t in (x, z, gate_weight)] + [gate_bias] + [t.to(dtype) for t in (w1, w3, w2)]


def _case(N, d, L, I, E, k, act, hot=None, renorm=True):
    return pytest.param(N, d, L, I, E, k, act, hot, renorm,
                        id=f"N{N}-d{d}-L{L}-I{I}-E{E}-k{k}-{act}" + ("" if hot is None else f"-hot{hot}")
                        + ("" if renorm else "-raw"))


@pytest.mark.parametrize("N, d, L, I, E, k, act, hot, renorm", [
    _case(13, 24, 40, 24, 6, 2, "situ"),  # random routing, non-power-of-two dims
    _case(13, 24, 40, 24, 6, 2, "silu", renorm=False),  # SiLU-GLU, raw sigmoid weights
    _case(9, 24, 20, 36, 5, 1, "situ", hot=3),  # top-1, one expert gets every token, four get none
    _case(40, 16, 24, 20, 3, 2, "situ", hot=0),  # overloaded expert spanning several row blocks
    _case(5, 24, 20, 36, 12, 3, "situ"),  # more experts than pairs: most experts empty
    _case(7, 16, 20, 24, 6, 6, "silu"),  # top_k = E: every expert sees every token
    _case(3, 16, 72, 40, 4, 2, "situ"),  # L and I above one 64-wide tile, masked tails
    _case(11, 16, 24, 18, 5, 2, "situ"),  # w2 rows of 72 bytes: GEMM2 on pointer loads, not TMA
])
def test_moe_matches_reference(N, d, L, I, E, k, act, hot, renorm, device):
    args = _inputs(N, d, L, I, E, hot=hot, device=device) + [k, 1.5, renorm, act, 4.0, 25.0]
    out = kernels.moe(*args)
    assert out.shape == (N, L) and out.dtype == args[1].dtype
    assert_close(out, reference.moe(*args), torch.float32, what="u")


def run_with(module, args: list, names: tuple[str, ...], overrides: dict) -> torch.Tensor:
    """The family's whole plan with `overrides` in its attrs (block_m: rows per block, hence swap-AB below 64;
    gemm_programs: the persistent GEMMs' grid) -> u."""
    from k3x.plan.dtypes import dtype_name
    from k3x.plan.launch import run

    names = tuple(n for n in names if n != "expert_offset")  # one GPU: offset 0, every expert local
    tensors = dict(zip(names, (t.contiguous() for t in args[:len(names)])))
    z = tensors["z"]
    tensors["expert_offset"] = torch.zeros(1, dtype=torch.int32, device=z.device)
    tensors["u"] = torch.empty(z.shape[0], z.shape[1], dtype=z.dtype, device=z.device)
    attrs = kernels.plan_attrs(*args[len(names):]) | overrides
    d = module.dims([t.shape for t in tensors.values()])
    plan = module.plan(d, [dtype_name(t.dtype) for t in tensors.values()], attrs)
    gemms = [x for x in plan.select(d).launches if "gemm" in x.kernel_name]
    assert [x.constexprs["SWAP"] for x in gemms] == [overrides["block_m"] < kernels.SWAP_BELOW] * 2
    assert all(x.grid(d)[0] <= overrides["gemm_programs"] for x in gemms)
    run(plan, tensors, d)
    return tensors["u"]


@pytest.mark.parametrize("block_m, programs", [(16, 1), (16, 3), (64, 2), (128, 5)])
def test_moe_gemm_orientations_and_persistent_grid(block_m, programs, device):
    """Swap-AB (BM < 64) and plain tiles, each with a persistent grid smaller than the tile count (every program
    walks several tiles, including the unused tail blocks), agree with the reference; y in z's dtype."""
    args = _inputs(70, 16, 72, 40, 5, hot=1, device=device) + [2, 1.5, True, "situ", 4.0, 25.0]
    names = ("x", "z", "gate_weight", "gate_bias", "w1", "w3", "w2")
    out = run_with(kernels, args, names, {"block_m": block_m, "gemm_programs": programs})
    assert_close(out, reference.moe(*args), torch.float32, what=f"u BM={block_m}")


def test_moe_misaligned_experts(device):
    """w3 4 bytes off a 16-byte boundary (a view into a larger buffer): GEMM1 addresses w3's rows from w1's base
    with an offset declared 16-byte aligned, so the launcher copies such tensors first."""
    args = _inputs(13, 24, 40, 24, 6, device=device) + [2, 1.5, True, "situ", 4.0, 25.0]
    buf = torch.empty(args[5].numel() + 1, device=device)
    buf[1:] = args[5].reshape(-1)
    args[5] = buf[1:].view_as(args[5])
    assert args[5].data_ptr() % 16 == 4
    assert_close(kernels.moe(*args), reference.moe(*args), torch.float32, what="u")


@pytest.mark.parametrize("k, renorm", [(1, True), (4, True), (4, False), (9, True)])
def test_route_matches_reference(k, renorm, device):
    x, _, gw, gb, *_ = _inputs(11, 40, 8, 8, 9, device=device)
    ids, w = kernels.route(x, gw, gb, k, 2.5, renorm)
    rids, rw = reference.route(x, gw, gb, k, 2.5, renorm)
    assert ids.dtype == torch.int64 and w.dtype == torch.float32
    assert torch.equal(ids, rids)  # both in descending order of biased score
    assert_close(w, rw, torch.float32, what="weights")


def _align_oracle(ids: torch.Tensor, E: int, BM: int, P: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch bookkeeping for `moe_align`: a stable sort of the pairs by expert, segments padded to BM."""
    flat = ids.reshape(-1)  # [NK]
    NK = flat.numel()
    counts = torch.bincount(flat, minlength=E)  # [E]
    padded = (counts + BM - 1) // BM * BM
    pad_end = padded.cumsum(0)  # [E], inclusive
    order = torch.argsort(flat, stable=True)  # pair ids grouped by expert
    rank = torch.arange(NK, device=ids.device) - (counts.cumsum(0) - counts)[flat[order]]  # index inside segment
    sorted_pair = torch.full((P,), NK, dtype=torch.int32, device=ids.device)
    sorted_pair[(pad_end - padded)[flat[order]] + rank] = order.to(torch.int32)
    block_start = torch.arange(0, P, BM, device=ids.device)
    block_expert = torch.searchsorted(pad_end, block_start, right=True)  # first expert ending after the block start
    return sorted_pair, torch.where(block_start < pad_end[-1], block_expert, -1).to(torch.int32)


def _align_case(N, k, E, how):
    return pytest.param(N, k, E, how, id=f"N{N}-k{k}-E{E}-{how}")


@pytest.mark.parametrize("N, k, E, how", [
    _align_case(3, 2, 4, "fixed"),  # expert 3 empty; one block per non-empty expert
    _align_case(37, 3, 64, "random"),  # odd N, most experts empty or single-pair
    _align_case(301, 1, 5, "one"),  # every token to expert 2: several BM blocks, two chunks of pairs
    _align_case(11, 7, 7, "all"),  # top_k = E: every expert sees every token
    _align_case(130, 2, 3, "random"),  # several chunks of ALIGN_BLOCK pairs feed each expert
    _align_case(5, 2, 300, "random"),  # E > 256: several expert tiles in the count kernel
])
def test_moe_align_matches_oracle(N, k, E, how, device):
    if how == "fixed":
        ids = torch.tensor([[2, 0], [2, 1], [2, 0]])
    elif how == "one":
        ids = torch.full((N, k), 2)
    elif how == "all":
        ids = torch.stack([torch.randperm(E) for _ in range(N)])
    else:
        ids = torch.stack([torch.randperm(E)[:k] for _ in range(N)])  # distinct experts per token, as top-k gives
    ids = ids.to(device)
    for BM in (16, 64):
        P = kernels.padded_rows(N * k, E, BM)
        sorted_pair, block_expert = kernels.moe_align(ids, E, BM)
        want_pair, want_expert = _align_oracle(ids, E, BM, P)
        assert sorted_pair.dtype == block_expert.dtype == torch.int32
        assert sorted_pair.shape == (P,) and block_expert.shape == (P // BM,)
        assert torch.equal(sorted_pair, want_pair), f"BM={BM}"  # the stable sort, exactly: deterministic layout
        assert torch.equal(block_expert, want_expert), f"BM={BM}"
    if how == "fixed":
        assert block_expert.tolist()[:4] == [0, 1, 2, -1]


@pytest.mark.gpu
@pytest.mark.parametrize("N, E, k", [(512, 64, 8), (4, 896, 16), (300, 7, 7)])
def test_moe_bf16_gpu(N, E, k, device):
    args = _inputs(N, 256, 384, 192, E, dtype=torch.bfloat16, device=device) + [k, 1.0, True, "situ", 4.0, 25.0]
    out = kernels.moe(*args)
    assert out.dtype == torch.bfloat16
    assert_close(out, reference.moe(*args), torch.bfloat16, what="bf16 u")


def test_gpu_check_moe_steps_run_the_plan(device):
    """bench/gpu_check's MoE benchmark times the plan's own steps (align, GEMM1, GEMM2, sum) on fixed routing:
    what it times computes the routed experts."""
    from k3x.bench.gpu_check_bench import moe_steps

    N, L, I, E, k = 21, 40, 24, 6, 3
    _, z, _, _, w1, w3, w2 = _inputs(N, 16, L, I, E, device=device)
    ids = torch.stack([torch.randperm(E)[:k] for _ in range(N)]).to(device)
    wts = torch.rand(N, k, device=device)
    steps = moe_steps(kernels, z, ids, wts, {"w1": w1, "w3": w3, "w2": w2}, sm=90)
    env = steps["experts"]()
    want = reference.routed_experts(z, ids, wts, E, lambda e: (w1[e], w3[e], w2[e]), "situ", 4.0, 25.0)
    assert_close(env["u"], want, torch.float32, what="u")
    for name in ("gemm1", "gemm2"):
        steps[name]()
