"""Plugin core on CPU: fields = ONNX attributes, shape/format rules, and the AOT kernels for sm_90.

The AOT tests compile every kernel a plugin embeds with `triton.compile(..., GPUTarget("cuda", 90, 32))` (no
GPU needed) and check what the engine carries: entry names, argument order, PTX parameter count, shared memory.
"""

from __future__ import annotations

import dataclasses

import pytest

from k3x.custom_ops.attn_res import attn_res_output_shape
from k3x.custom_ops.kda import kda_output_shapes
from k3x.custom_ops.registry import families
from k3x.custom_ops.trt_plugins import specs
from k3x.plan.launch import PlanError, workspace_layout
from k3x.plugins import PluginError, aot
from k3x.plugins.adapter import compile_plan

NODE_SPECS = {f.onnx.NODE.op_type: f.onnx.NODE for f in families()}

SPECS = specs()
KDA_DIMS = [dict(B=1, T=1, H=2, K=16, V=32), dict(B=2, T=40, H=2, K=16, V=32), dict(B=4, T=128, H=2, K=16, V=32)]
KDA_TYPES = ["bf16"] * 3 + ["fp32"] * 3 + ["bf16", "fp32"]


@pytest.mark.parametrize("name", sorted(SPECS))
def test_fields_are_the_onnx_attributes(name):
    assert [f.name for f in SPECS[name].fields] == [n for n, _ in NODE_SPECS[name].fields]


def test_shape_rules_are_the_ops_rules():
    q, v = (2, 7, 3, 16), (2, 7, 3, 32)
    assert SPECS["KDA"].output_shapes([q, q, v, q, (2, 7, 3), (2, 3, 16, 32)]) == list(kda_output_shapes(q, v))
    assert SPECS["AttnRes"].output_shapes([(2, 7, 64), (2, 7, 3, 64), (64,), (64,)]) == [attn_res_output_shape((2, 7, 64))]
    assert SPECS["MoE"].output_shapes([(9, 64), (9, 32)] + [()] * 5) == [(9, 32)]


def test_shape_checks_name_the_tensor():
    kda = SPECS["KDA"]
    q, v = [2, 7, 3, 16], [2, 7, 4, 16]
    reason = kda.check([q, q, v, q, [2, 7, 3], [2, 3, 16, 16]], {"num_heads": 3, "head_dim": 16, "value_dim": 16})
    assert reason and "v[:3]" in reason
    assert kda.check([q, q, [2, 7, 3, 16], q, [2, 7, 3], [2, 3, 16, 16]],
                     {"num_heads": 3, "head_dim": 16, "value_dim": 16}) is None
    unknown = [None, None, 3, 16]  # dynamic dims are unknown at shape-function time: not an error
    assert kda.check([unknown] * 3 + [unknown, [None, None, 3], [None, 3, 16, 16]], {}) is None
    assert "N <= 15" in SPECS["AttnRes"].check([[5, 64], [5, 16, 64], [64], [64]], {"hidden_size": 64})


def test_formats_enforced():
    kda = SPECS["KDA"]
    kda.check_dtypes(KDA_TYPES)
    with pytest.raises(PluginError, match="'g' has dtype fp16, supported: fp32"):
        kda.check_dtypes(["bf16"] * 3 + ["fp16"] + ["fp32"] * 2 + ["bf16", "fp32"])
    with pytest.raises(PluginError, match="'k' has dtype fp16, supported: the dtype of q"):
        kda.check_dtypes(["bf16", "fp16"] + KDA_TYPES[2:])
    assert not kda.supports(6, ["bf16"] * 3 + ["fp32"] * 3 + ["fp16", "fp32"])  # o must match v


def test_kda_aot_kernels_sm90():
    spec = SPECS["KDA"]
    plan = spec.plan(KDA_DIMS[1], KDA_TYPES, {"scale": 0.25, "gate_lower_bound": -5.0})
    kernels = {k.name: k for k in compile_plan(spec, plan, KDA_TYPES, 90, KDA_DIMS)}
    assert set(kernels) == {"_kda_recurrent_kernel", "_kda_intra_kernel", "_kda_state_kernel"}
    rec = kernels["_kda_recurrent_kernel"]  # QDP argument order: inputs, int32 scalars, outputs
    assert rec.arg_names == ("q", "k", "v", "g", "beta", "initial_state", "T", "o", "final_state")
    assert rec.arg_types == ("*bf16",) * 3 + ("*fp32",) * 3 + ("i32", "*bf16", "*fp32")
    intra, state = kernels["_kda_intra_kernel"], kernels["_kda_state_kernel"]
    assert intra.arg_names[-2:] == ("T", "NT") and state.arg_names[6:9] == ("initial_state", "o", "final_state")
    for k in kernels.values():
        assert k.sm == 90 and k.cubin[:4] == b"\x7fELF" and k.n_params == len(k.arg_names) + 2  # + scratch ptrs
        assert k.block[0] == 32 * k.num_warps and 0 <= k.shared <= 227 * 1024
    # variant choice follows the torch op: recurrent up to RECURRENT_MAX_T tokens, chunked above
    assert plan.select(dict(KDA_DIMS[0])).name == "recurrent" and plan.select(dict(KDA_DIMS[2])).name == "chunked"
    grid = plan.select(dict(KDA_DIMS[2])).launches[0].grid(KDA_DIMS[2])
    assert grid == (2, 8, 1)  # (ceil(128 / 64) chunks, B * H)


def test_attn_res_aot_kernel_sm90():
    spec = SPECS["AttnRes"]
    dims = [dict(R=1, N=3, d=64), dict(R=16, N=3, d=64), dict(R=512, N=3, d=64)]
    types = ["fp16"] * 5
    plan = spec.plan(dims[1], types, {"eps": 1e-6})
    (k,) = compile_plan(spec, plan, types, 90, dims)
    assert k.name == "_attn_res_kernel" and k.arg_names == ("prefix", "bank", "norm_weight", "proj_weight", "out")
    assert k.arg_types == ("*fp16",) * 5 and k.n_params == 7
    assert plan.variants[0].launches[0].grid(dims[2]) == (512, 1, 1)


def test_bundle_roundtrip_and_workspace():
    spec = SPECS["AttnRes"]
    dims = dict(R=4, N=2, d=32)
    ks = compile_plan(spec, spec.plan(dims, ["fp32"] * 5, {"eps": 1e-5}), ["fp32"] * 5, 90, [dims])
    meta, back = aot.unpack(aot.pack(ks, {"plugin": "k3::AttnRes"}))
    assert meta == {"plugin": "k3::AttnRes"} and [b.cubin for b in back.values()] == [k.cubin for k in ks]
    with pytest.raises(PluginError, match="bad magic"):
        aot.unpack(b"garbage" * 4)
    plan = SPECS["KDA"].plan(KDA_DIMS[1], KDA_TYPES, {"scale": 0.25})
    offsets, total = workspace_layout(plan.workspace, KDA_DIMS[2])
    assert all(o % 256 == 0 for o in offsets) and total >= 4 * 128 * 2 * (3 * 16 + 32 + 64) * 2


MOE_ATTRS = dict(top_k=2, routed_scaling_factor=1.5, renormalize=1, activation="situ", situ_beta=4.0,
                 situ_linear_beta=25.0, num_experts=8, hidden_size=64, expert_dim=64, intermediate_size=32)
MOE_DIMS = [dict(N=1, d=64, L=64, E=8, I=32), dict(N=16, d=64, L=64, E=8, I=32), dict(N=256, d=64, L=64, E=8, I=32)]
MOE_TYPES = ["bf16"] * 3 + ["fp32"] + ["bf16"] * 3 + ["int32", "bf16"]  # x z gate_weight gate_bias w1 w3 w2 expert_offset u


def test_moe_formats_enforced():
    moe = SPECS["MoE"]
    moe.check_dtypes(MOE_TYPES)
    moe.check_dtypes(["fp16", "fp16", "fp32", "fp32", "bf16", "bf16", "bf16", "int32", "fp16"])  # mixed: IEEE dots
    with pytest.raises(PluginError, match="'gate_bias' has dtype bf16, supported: fp32"):
        moe.check_dtypes(MOE_TYPES[:3] + ["bf16"] + MOE_TYPES[4:])
    with pytest.raises(PluginError, match="'w2' has dtype fp16, supported: the dtype of w1"):
        moe.check_dtypes(MOE_TYPES[:6] + ["fp16", "int32", "bf16"])
    with pytest.raises(PluginError, match="'expert_offset' has dtype int64, supported: int32"):
        moe.check_dtypes(MOE_TYPES[:7] + ["int64", "bf16"])
    assert not moe.supports(8, MOE_TYPES[:8] + ["fp32"])  # u must match z
    assert "LINEAR only" in moe.format_table()


def test_moe_aot_kernels_sm90():
    spec = SPECS["MoE"]
    attrs = spec.attrs(MOE_ATTRS)
    assert spec.resolve_path("aot") == "aot" and spec.resolve_path("jit") == "jit"
    plan = spec.plan(MOE_DIMS[1], MOE_TYPES, attrs)
    (variant,) = plan.variants
    assert [l.kernel_name for l in variant.launches] == [
        "_router_kernel", "_topk_kernel", "_moe_align_count_kernel", "_moe_align_scan_kernel",
        "_moe_align_scatter_kernel", "_moe_gemm1_kernel", "_moe_gemm2_kernel", "_moe_sum_kernel"]
    ks = {k.name: k for k in compile_plan(spec, plan, MOE_TYPES, 90, MOE_DIMS)}
    assert len(ks) == 8
    args = {n: (k.arg_names, k.arg_types) for n, k in ks.items()}
    assert args["_router_kernel"] == (("x", "gate_weight", "s", "N", "EG", "d"),  # routes over all EG experts
                                      ("*bf16", "*bf16", "*fp32", "i32", "i32", "i32"))
    assert args["_topk_kernel"] == (("s", "gate_bias", "ids", "wts", "expert_offset", "EG", "E"),
                                    ("*fp32", "*fp32", "*i64", "*fp32", "*i32", "i32", "i32"))
    assert args["_moe_align_count_kernel"][0] == ("ids", "counts", "NK", "E")
    assert args["_moe_align_scan_kernel"][0] == ("counts", "offsets", "sorted_pair", "block_expert", "NK", "E", "NB",
                                                 "P")
    assert args["_moe_align_scatter_kernel"][0] == ("ids", "offsets", "sorted_pair", "NK", "E")
    assert args["_moe_gemm1_kernel"] == (("z", "w1", "w3", "sorted_pair", "block_expert", "h", "NK", "I", "L", "num_m"),
                                         ("*bf16",) * 3 + ("*i32",) * 2 + ("*bf16",) + ("i32",) * 4)
    assert args["_moe_gemm2_kernel"][0] == ("h", "w2", "sorted_pair", "block_expert", "wts", "y", "NK", "I", "L",
                                            "E", "num_m")
    assert args["_moe_sum_kernel"] == (("y", "ids", "u", "L"), ("*bf16", "*i64", "*bf16", "i32"))  # y in z's dtype
    for k in ks.values():  # routing factor, betas, top_k and tiles are specialised: no float arguments
        assert k.sm == 90 and k.cubin[:4] == b"\x7fELF" and k.n_params == len(k.arg_names) + 2
        assert set(k.arg_types) <= {"*bf16", "*fp32", "*i32", "*i64", "i32"}
    # 16-divisible sizes get the JIT's hint (L = 64, I = 32, d = 64; E = 8 and the dynamic sizes do not; P always)
    assert ks["_moe_gemm1_kernel"].divisible == ("z", "w1", "w3", "sorted_pair", "block_expert", "h", "I", "L")
    assert ks["_router_kernel"].divisible == ("x", "gate_weight", "s", "d")
    assert "P" in ks["_moe_align_scan_kernel"].divisible


def test_moe_mxfp4_plugin_plans_the_ops_w4a8_gemms():
    """The MoEMXFP4 plugin plans for its build target (attrs["sm"], as `adapter` passes it) exactly as the op's
    Triton path does: with the activations field "mxfp8", FP8-dot GEMMs on sm_90 (F8: compiled to wgmma e4m3 in
    tests/bench/test_kernel_resources.py) and block-scaled ones on sm_100; "bf16" keeps the decode path."""
    from k3x.custom_ops.moe import triton as dense
    from k3x.custom_ops.moe_mxfp4 import triton as kt

    spec, d = SPECS["MoEMXFP4"], MOE_DIMS[1]
    types = ["bf16"] * 3 + ["fp32"] + ["int8"] * 6 + ["int32", "bf16"]  # the byte ports as TensorRT passes them
    op_attrs = dense.plan_attrs(2, 1.5, True, "situ", 4.0, 25.0)
    gemms = lambda plan: [x for x in plan.select(d).launches if "gemm" in x.kernel_name]  # noqa: E731
    for activations, sm, f8, scaled in (("mxfp8", 90, True, False), ("mxfp8", 100, False, True),
                                        ("bf16", 90, False, False)):
        plugin = gemms(spec.plan(d, types, spec.attrs(MOE_ATTRS | {"activations": activations}) | {"sm": sm}))
        assert [(x.constexprs["F8"], x.constexprs["SCALED"]) for x in plugin] == [(f8, scaled)] * 2
        op = gemms(kt.plan(d, types, op_attrs | {"sm": sm, "activations": activations}))
        assert [(x.kernel_name, x.constexprs, x.num_warps) for x in plugin] == [
            (x.kernel_name, x.constexprs, x.num_warps) for x in op]


def test_moe_tma_scratch_carved_from_the_workspace():
    """GEMM2 reads w2 through a TMA descriptor built on the device: 128 B of global scratch per program, which
    run_plan passes right after the plan's workspace and get_workspace_size counts at the max shape."""
    from k3x.plugins.adapter import run_plan, scratch_size

    spec = SPECS["MoE"]
    plan = spec.plan(MOE_DIMS[1], MOE_TYPES, spec.attrs(MOE_ATTRS) | {"sm": 90})
    kernels = {k.key: k for k in compile_plan(spec, plan, MOE_TYPES, 90, MOE_DIMS)}
    assert {k.name: k.scratch for k in kernels.values()}["_moe_gemm2_kernel"] == 128
    assert sum(k.scratch for k in kernels.values()) == 128  # only GEMM2
    assert aot.unpack(aot.pack(list(kernels.values()), {}))[1][next(
        k.key for k in kernels.values() if k.scratch)].scratch == 128  # travels in the engine
    hi = MOE_DIMS[2]
    gemm2 = next(x for x in plan.variants[0].launches if x.kernel_name == "_moe_gemm2_kernel")
    assert scratch_size(spec, plan, kernels, MOE_TYPES, hi, 90) == 128 * gemm2.grid(hi)[0]

    class Recorder:
        calls: list = []

        def launch(self, k, grid, values, stream, scratch=0):
            self.calls.append((k.name, scratch))

    ptrs = [0x10000 * (i + 1) for i in range(len(spec.ports))]
    shapes = [(37, 64), (37, 64), (8, 64), (8,), (8, 32, 64), (8, 32, 64), (8, 64, 32), (37, 64)]
    run_plan(spec, plan, kernels, Recorder(), shapes, MOE_TYPES, ptrs, 0x7F0000000000, 0, 90)
    end = 0x7F0000000000 + workspace_layout(plan.workspace, spec.dims(shapes[:7]))[1]
    assert dict(Recorder.calls) == {n: (end if n == "_moe_gemm2_kernel" else 0) for n, _ in Recorder.calls}
    assert len(Recorder.calls) == 8


def test_moe_grids_and_scalars_follow_runtime_n():
    spec = SPECS["MoE"]
    plan = spec.plan(MOE_DIMS[1], ["fp32"] * 8, spec.attrs(MOE_ATTRS))  # opt N=16: 32 pairs / 8 experts -> BM 16
    run = dict(MOE_DIMS[1], N=37)  # 74 pairs: P = ceil((74 + 8·15) / 16)·16 = 208 rows, 13 blocks
    launches = {l.kernel_name: l for l in plan.variants[0].launches}
    sc = launches["_moe_align_scan_kernel"].scalars(run)
    assert {k: sc[k] for k in ("N", "NK", "NB", "P", "num_m")} == {"N": 37, "NK": 74, "NB": 1, "P": 208, "num_m": 13}
    grids = {n: tuple(l.grid(run)) for n, l in launches.items()}
    assert grids == {"_router_kernel": (2, 1, 1), "_topk_kernel": (37, 1, 1), "_moe_align_count_kernel": (1, 1, 1),
                     "_moe_align_scan_kernel": (1, 1, 1), "_moe_align_scatter_kernel": (1, 1, 1),
                     "_moe_gemm1_kernel": (13, 1, 1), "_moe_gemm2_kernel": (13, 1, 1), "_moe_sum_kernel": (37, 1, 1)}
    assert launches["_moe_gemm1_kernel"].constexprs["BM"] == 16
    with pytest.raises(PlanError, match="runtime E=16 differs from the planned 8"):
        launches["_moe_sum_kernel"].scalars(dict(run, E=16))


def test_moe_workspace_from_max_shape():
    spec = SPECS["MoE"]
    plan = spec.plan(MOE_DIMS[1], ["fp32"] * 8, spec.attrs(MOE_ATTRS))
    offsets, total = workspace_layout(plan.workspace, MOE_DIMS[2])  # N = 256: 512 pairs, P = 640 rows (BM 16)
    sizes = {"s": 256 * 8 * 4, "ids": 512 * 8, "wts": 512 * 4, "counts": 2 * 8 * 4, "offsets": 2 * 8 * 4, "sorted_pair": 640 * 4,
             "block_expert": 40 * 4, "h": 640 * 32 * 4, "y": 512 * 64 * 4}
    assert [b.name for b in plan.workspace] == list(sizes)
    assert all(o % 256 == 0 for o in offsets)
    assert total == sum((v + 255) // 256 * 256 for v in sizes.values()) == 230656


def test_divisibility_hints_and_enforcement():
    spec = SPECS["AttnRes"]
    dims = dict(R=4, N=2, d=32)
    (k,) = compile_plan(spec, spec.plan(dims, ["fp32"] * 5, {"eps": 1e-5}), ["fp32"] * 5, 90, [dims])
    assert k.divisible == k.arg_names  # every pointer
    _, back = aot.unpack(aot.pack([k], {}))
    assert next(iter(back.values())).divisible == k.divisible  # travels in the engine
    ok = {a: 0x7F0000000100 for a in k.arg_names}
    aot.check_divisible(k, ok)
    with pytest.raises(PluginError, match="bank=0x7f0000000108"):
        aot.check_divisible(k, ok | {"bank": 0x7F0000000108})
    moe = SPECS["MoE"]
    gemm1 = next(l for l in moe.plan(MOE_DIMS[1], MOE_TYPES, moe.attrs(MOE_ATTRS)).variants[0].launches
                 if l.kernel_name == "_moe_gemm1_kernel")
    types = (dict(zip([p.name for p in moe.ports], MOE_TYPES)) | {"sorted_pair": "int32", "block_expert": "int32"}
             | {"h": "bf16"} | dict.fromkeys(("NK", "I", "L", "num_m"), "i32"))
    sig = aot.signature(gemm1, types)
    attrs = aot.divisibility_attrs(gemm1, sig)  # the form triton/tools/compile.py and the JIT pass to ASTSource
    names = gemm1.kernel.arg_names
    assert {names[i] for (i,) in attrs} == {"z", "w1", "w3", "sorted_pair", "block_expert", "h", "I", "L"}
    assert all(v == [["tt.divisibility", 16]] for v in attrs.values())
    with pytest.raises(PluginError, match="not int32 scalar args"):
        aot.divisible_args(dataclasses.replace(gemm1, divisible=("z",)), sig)


def _ptxas_spills(ptx: str) -> int | None:
    """Spill-store bytes `ptxas -v` reports for sm_90a (Triton's bundled ptxas, else CUDA's), or None."""
    import os
    import re
    import shutil
    import subprocess
    import tempfile

    import triton

    exe = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    exe = exe if os.path.isfile(exe) else shutil.which("ptxas")
    if exe is None:
        return None
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.ptx")
        with open(path, "w") as f:
            f.write(ptx)
        r = subprocess.run([exe, "-v", "--gpu-name", "sm_90a", path, "-o", os.devnull], capture_output=True, text=True)
    m = re.search(r"(\d+) bytes spill stores", r.stderr)
    return int(m.group(1)) if r.returncode == 0 and m else None


def test_divisibility_hints_reach_the_code(monkeypatch):
    """K3-sized bf16 GEMM1: with the hints (as the JIT compiles it) the A/B tile loads become `cp.async` copies
    (software pipelining) and nothing spills; without them neither holds (432 B of spills with triton 3.8)."""
    moe = SPECS["MoE"]
    k3 = dict(N=4096, d=7168, L=3584, E=896, I=3072)
    attrs = moe.attrs(MOE_ATTRS | dict(top_k=16, num_experts=896, hidden_size=7168, expert_dim=3584,
                                       intermediate_size=3072))
    gemm1 = next(l for l in moe.plan(k3, MOE_TYPES, attrs).variants[0].launches if l.kernel_name == "_moe_gemm1_kernel")
    types = (dict(zip([p.name for p in moe.ports], MOE_TYPES)) | {"sorted_pair": "int32", "block_expert": "int32"}
             | {"h": "bf16"} | dict.fromkeys(gemm1.scalars(k3), "i32"))
    hinted = aot.compile_launch(gemm1, types, 90, keep_ptx=True)
    monkeypatch.setattr(aot, "divisibility_attrs", lambda *a: {})
    monkeypatch.setattr(aot, "_CACHE", {})
    plain = aot.compile_launch(gemm1, types, 90, keep_ptx=True)
    assert "cp.async" in hinted.ptx and "cp.async" not in plain.ptx
    spills = (_ptxas_spills(hinted.ptx), _ptxas_spills(plain.ptx))
    if None not in spills:
        assert spills[0] == 0 and spills[1] > 0, spills
