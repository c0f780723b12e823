"""The AOT plans run end to end on CPU: `adapter.run_plan` — the code `enqueue` runs — with the plan's own
argument order, grids, int32 scalars, divisibility checks and workspace layout, but with the Triton
interpreter standing in for the CUDA driver (`_InterpretedDriver` launches the plan's JIT function on views of
the same host buffers). Compared with the fp32 references.

TRITON_INTERPRET=1 must be set before Triton is imported, so `test_plans_under_interpreter` re-runs this file in
a child process with it; the `test_child_*` cases are skipped in any other process.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
child = pytest.mark.skipif(not INTERPRET, reason="runs in the TRITON_INTERPRET=1 child of test_plans_under_interpreter")
TORCH_DTYPE = {"*fp32": torch.float32, "*fp16": torch.float16, "*bf16": torch.bfloat16, "*i32": torch.int32,
               "*i64": torch.int64, "*u8": torch.uint8}


def test_plans_under_interpreter():
    if INTERPRET:
        pytest.skip("this is the child")
    root = Path(__file__).resolve().parents[2]
    # -n 0: one process (pyproject's addopts start xdist workers)
    proc = subprocess.run([sys.executable, "-m", "pytest", __file__, "-q", "-p", "no:cacheprovider", "-k", "child",
                           "-n", "0"], cwd=root, env={**os.environ, "TRITON_INTERPRET": "1"}, capture_output=True,
                          text=True, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert (m := re.search(r"(\d+) passed", out)) and int(m.group(1)) >= 3, out


class _InterpretedDriver:
    """`aot.CudaDriver.launch`'s contract on host memory: pointer values are resolved back to tensors."""

    def __init__(self, launches: dict, tensors: list[torch.Tensor], workspace: torch.Tensor):
        self.fns = launches  # kernel key -> Launch (one kernel may be launched with different constexprs)
        self.by_ptr = {t.data_ptr(): t for t in tensors}
        self.ws = workspace
        self.launched: list[str] = []

    def _tensor(self, ptr: int, ty: str) -> torch.Tensor:
        if ptr in self.by_ptr:
            return self.by_ptr[ptr].view(-1)
        off = ptr - self.ws.data_ptr()
        assert 0 <= off <= self.ws.numel(), "pointer outside the I/O tensors and the workspace"
        dt = TORCH_DTYPE[ty]
        n = (self.ws.numel() - off) // dt.itemsize
        return self.ws[off:off + n * dt.itemsize].view(dt)

    def launch(self, k, grid, values: dict, stream: int, scratch: int = 0) -> None:
        from k3x.plugins import aot

        assert bool(scratch) == bool(k.scratch), (k.name, scratch)  # the interpreter makes its own descriptors

        grid = tuple(int(g) for g in grid)
        if min(grid) <= 0:
            return
        aot.check_divisible(k, values)
        launch = self.fns[k.key]
        args = [self._tensor(int(values[a]), t) if t.startswith("*") else int(values[a])
                for a, t in zip(k.arg_names, k.arg_types)]
        launch.kernel[grid](*args, **launch.constexprs, num_warps=launch.num_warps, num_stages=launch.num_stages)
        self.launched.append(k.name)


def _fake_kernels(spec, plan, dtypes: list[str], dims: dict) -> tuple[dict, dict]:
    """What `aot.unpack` gives `run_plan`, without compiling (the interpreter process cannot): keys, names,
    argument order and types, divisibility — from the same `aot` functions `compile_launch` uses; and the
    launch of each key."""
    from k3x.plugins import aot

    types = dict(zip([p.name for p in spec.ports], dtypes)) | {b.name: b.dtype for b in plan.workspace}
    out, launches = {}, {}
    for v in plan.variants:
        for launch in v.launches:
            sig = aot.signature(launch, types | {n: "i32" for n in launch.scalars(dims)})
            key = aot.launch_key(launch, sig, 90)
            arg_types = tuple(sig[p] for p in launch.kernel.arg_names if p not in launch.constexprs)
            out[key] = aot.CompiledKernel(key=key, name=launch.kernel_name, sm=90, arg_names=launch.args,
                                          arg_types=arg_types, n_params=0, num_warps=launch.num_warps, shared=0,
                                          cubin=b"", divisible=aot.divisible_args(launch, sig))
            launches[key] = launch
    return out, launches


def _run(spec, opt_dims: dict, tensors: list[torch.Tensor], attrs: dict) -> list[str]:
    from k3x.plan.launch import workspace_layout
    from k3x.plugins.adapter import run_plan

    names = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.int32: "int32"}
    dtypes = [names[t.dtype] for t in tensors]
    shapes = [tuple(t.shape) for t in tensors]
    plan = spec.plan(opt_dims, dtypes, attrs)
    run_dims = spec.dims(shapes[:len(spec.inputs)])
    ws = torch.full((workspace_layout(plan.workspace, run_dims)[1] + 256,), 255, dtype=torch.uint8)  # NaN / -1
    ws = ws[(-ws.data_ptr()) % 256:]  # TensorRT hands out 256-byte-aligned workspaces
    kernels, launches = _fake_kernels(spec, plan, dtypes, spec.dims([tuple(s) for s in shapes[:len(spec.inputs)]]))
    driver = _InterpretedDriver(launches, tensors, ws)
    run_plan(spec, plan, kernels, driver, shapes, dtypes, [t.data_ptr() for t in tensors], ws.data_ptr(), 0, 90)
    return driver.launched


@child
@pytest.mark.parametrize("N, opt_N, E, k, hot", [
    pytest.param(21, 4, 6, 2, None, id="N21-opt4-E6-k2"),  # odd N, planned at another N
    pytest.param(40, 40, 4, 4, None, id="N40-E4-k4"),  # top_k = E
    pytest.param(9, 1, 5, 1, 3, id="N9-opt1-E5-k1-hot3"),  # every token to one expert, four empty
])
def test_child_moe_plan(N, opt_N, E, k, hot):
    from k3x.custom_ops.moe import reference
    from k3x.custom_ops.trt_plugins import specs

    spec = specs()["MoE"]
    d, L, I = 16, 32, 48
    x, z = torch.randn(N, d), torch.randn(N, L)
    gw, gb = torch.randn(E, d) * d ** -0.5, torch.randn(E) * 0.1
    if hot is not None:
        gb[hot] = 100.0
    w1, w3, w2 = torch.randn(E, I, L) * L ** -0.5, torch.randn(E, I, L) * L ** -0.5, torch.randn(E, L, I) * I ** -0.5
    u = torch.full((N, L), float("nan"))
    attrs = spec.attrs(dict(top_k=k, routed_scaling_factor=1.5, renormalize=1, activation="situ", situ_beta=4.0,
                            situ_linear_beta=25.0, num_experts=E, hidden_size=d, expert_dim=L, intermediate_size=I))
    off = torch.zeros(1, dtype=torch.int32)  # one GPU: every expert is local
    launched = _run(spec, dict(N=opt_N, d=d, L=L, E=E, I=I), [x, z, gw, gb, w1, w3, w2, off, u], attrs)
    assert len(launched) == 8
    want = reference.moe(x, z, gw, gb, w1, w3, w2, k, 1.5, True, "situ", 4.0, 25.0)
    torch.testing.assert_close(u, want, rtol=1e-4, atol=1e-5)


@child
def test_child_attn_res_plan():
    from k3x.custom_ops.attn_res import reference
    from k3x.custom_ops.trt_plugins import specs

    spec = specs()["AttnRes"]
    R, N, d = 5, 3, 48
    prefix, bank = torch.randn(R, d), torch.randn(R, N, d)
    nw, pw = 1 + 0.1 * torch.randn(d), 0.05 * torch.randn(d)
    out = torch.full((R, d), float("nan"))
    assert _run(spec, dict(R=16, N=N, d=d), [prefix, bank, nw, pw, out], {"eps": 1e-5}) == ["_attn_res_kernel"]
    torch.testing.assert_close(out, reference.attn_res(prefix, bank, nw, pw, 1e-5), rtol=1e-4, atol=1e-5)


@child
@pytest.mark.parametrize("lens, launched", [
    pytest.param([1, 1, 1], ["_kda_recurrent_kernel"], id="decode"),
    pytest.param([1, 20, 2, 70], ["_kda_recurrent_kernel", "_kda_intra_kernel", "_kda_state_kernel"], id="mixed"),
])
def test_child_kda_packed_plan(lens, launched):
    """k3::KDAPacked's plan through run_plan (workspace poisoned, sized by N; planned at other dims)."""
    from k3x.custom_ops.kda_packed import reference
    from k3x.custom_ops.trt_plugins import specs
    from packed_steps import kda_step

    spec = specs()["KDAPacked"]
    q, k, v, g, beta, pool, cu, slots = kda_step(lens, H=2, K=16, V=32, seed=len(lens))
    o = torch.full(v.shape, float("nan"))
    s = torch.full((len(lens), *pool.shape[1:]), float("nan"))
    attrs = {"scale": 0.25, "num_heads": 2, "head_dim": 16, "value_dim": 32, "gate_lower_bound": -5.0}
    got = _run(spec, dict(N=128, B=8, H=2, K=16, V=32), [q, k, v, g, beta, pool, cu, slots, o, s], attrs)
    assert got == launched
    ro, rs = reference.kda_packed(q, k, v, g, beta, pool, cu, slots, scale=0.25)
    torch.testing.assert_close(o, ro, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(s, rs, rtol=1e-4, atol=1e-5)


@child
@pytest.mark.parametrize("seqs, opt, kernels", [
    pytest.param([(9, 1), (0, 1), (300, 1)], dict(N=3, B=3), ["_mla_paged_split_kernel", "_mla_paged_combine_kernel"],
                 id="decode-B3-2-splits"),  # partials in the workspace
    pytest.param([(5, 7), (0, 1), (13, 2)], dict(N=1, B=1), ["_mla_paged_kernel"], id="mixed-planned-at-decode"),
])
def test_child_mla_paged_plan(seqs, opt, kernels):
    from k3x.custom_ops.mla_paged import reference
    from k3x.custom_ops.trt_plugins import specs
    from paged_cases import paged_case

    spec = specs()["MLAPaged"]
    H, C, R, BS = 3, 20, 6, 4
    case = paged_case(seqs, BS, C + R)
    N = case.latent.shape[0]
    ql, qr = torch.randn(N, H, C), torch.randn(N, H, R)
    ins = [ql, qr, case.latent, *(x.contiguous() for x in case.paged)]
    o = torch.full((N, H, C), float("nan"))
    opt_dims = dict(H=H, C=C, R=R, NB=case.pool.shape[0], BS=BS, L=C + R, MB=case.block_table.shape[1]) | opt
    attrs = spec.attrs(dict(scale=0.2, num_heads=H, kv_lora_rank=C, rope_dim=R, block_size=BS))
    assert _run(spec, opt_dims, ins + [o], attrs) == kernels
    torch.testing.assert_close(o, reference.mla_paged(*ins, 0.2), rtol=1e-4, atol=1e-5)
