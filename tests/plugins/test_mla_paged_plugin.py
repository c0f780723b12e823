"""k3::MLAPaged TensorRT plugin spec (custom_ops/mla_paged/plugin.py) on CPU: fields = ONNX attributes, the
op's shape rule, shape checks naming the tensor, formats (int32 index ports), the launch plan's variants and
grids, and both variants' kernels compiled for sm_90 with the argument order the engine carries."""

from __future__ import annotations

import pytest

from k3x.custom_ops.mla_paged import mla_paged_output_shape
from k3x.custom_ops.mla_paged.onnx import NODE
from k3x.custom_ops.mla_paged.plugin import SPEC
from k3x.plugins import PluginError
from k3x.plugins.adapter import compile_plan

ATTRS = {"scale": 0.1, "num_heads": 16, "kv_lora_rank": 512, "rope_dim": 64, "block_size": 16}


def shapes(N=9, B=3, MB=5, NB=40, H=16, C=512, R=64, BS=16):
    return [[N, H, C], [N, H, R], [N, C + R], [NB, BS, C + R], [B, MB], [B], [B + 1]]


def test_spec_is_the_signature():
    assert SPEC.name == "MLAPaged" and [f.name for f in SPEC.fields] == [n for n, _ in NODE.fields]
    assert [f.name for f in SPEC.fields] == ["scale", "num_heads", "kv_lora_rank", "rope_dim", "block_size"]
    assert SPEC.output_shapes(shapes()) == [mla_paged_output_shape((9, 16, 512))]


def test_shape_checks_name_the_tensor():
    assert SPEC.check(shapes(), ATTRS) is None
    bad = shapes()
    bad[2] = [9, 512]
    assert "latent has shape" in SPEC.check(bad, ATTRS)
    bad = shapes()
    bad[6] = [3]
    assert "cu_seqlens" in SPEC.check(bad, ATTRS)
    assert "block_size=16 does not match the tensors' 8" in SPEC.check(shapes(BS=8), ATTRS)
    assert "<= 1024" in SPEC.check(shapes(C=1024), ATTRS | {"kv_lora_rank": 1024})
    unknown = [[None, 16, 512], [None, 16, 64], [None, 576], [None, 16, 576], [None, None], [None], [None]]
    assert SPEC.check(unknown, ATTRS) is None  # dynamic dims unknown at shape-function time: not an error


def test_formats_enforced():
    ok = ["bf16"] * 4 + ["int32"] * 3 + ["bf16"]
    SPEC.check_dtypes(ok)
    with pytest.raises(PluginError, match="'latent_pool' has dtype fp32, supported: the dtype of q_latent"):
        SPEC.check_dtypes(["bf16"] * 3 + ["fp32"] + ok[4:])
    with pytest.raises(PluginError, match="'block_table' has dtype fp32, supported: int32"):
        SPEC.check_dtypes(ok[:4] + ["fp32"] + ok[5:])


def test_plan_variants_and_grids():
    d = SPEC.dims(shapes())
    assert d == {"N": 9, "H": 16, "C": 512, "R": 64, "NB": 40, "BS": 16, "L": 576, "B": 3, "MB": 5}
    plan = SPEC.plan(d, ["bf16"] * 8, ATTRS)
    rows = plan.select(d)
    assert rows.name == "rows" and rows.launches[0].grid(d) == (3, 5, 1)  # BMR = 32 // 16 = 2 rows per program
    decode = SPEC.dims(shapes(N=3, MB=40))  # 640 keys: 3 splits of 256
    split, combine = plan.select(decode).launches
    assert plan.select(decode).name == "decode"
    assert split.grid(decode) == (3, 3, 1) and combine.grid(decode) == (3, 1, 1)
    assert split.scalars(decode) == {"MB": 40, "NSPLIT": 3} and combine.scalars(decode) == {"NSPLIT": 3}
    assert [b.numel(decode) for b in plan.workspace] == [3 * 3 * 16 * 512, 3 * 3 * 16 * 2]


def test_kernels_compile_for_sm90():
    types = ["bf16"] * 4 + ["int32"] * 3 + ["bf16"]
    dims = [SPEC.dims(shapes(N=1, B=1)), SPEC.dims(shapes()), SPEC.dims(shapes(N=300, B=8))]
    plan = SPEC.plan(dims[1], types, ATTRS)
    kernels = {k.name: k for k in compile_plan(SPEC, plan, types, 90, dims)}  # decode: N == B at the min point
    assert set(kernels) == {"_mla_paged_kernel", "_mla_paged_split_kernel", "_mla_paged_combine_kernel"}
    ins = ("q_latent", "q_rope", "latent", "latent_pool", "block_table", "past_lens", "cu_seqlens")
    assert kernels["_mla_paged_kernel"].arg_names == ins + ("MB", "o")
    assert kernels["_mla_paged_kernel"].arg_types == ("*bf16",) * 4 + ("*i32",) * 3 + ("i32", "*bf16")
    assert kernels["_mla_paged_split_kernel"].arg_names == ins + ("MB", "NSPLIT", "part_acc", "part_ml")
    assert kernels["_mla_paged_split_kernel"].arg_types[-2:] == ("*fp32", "*fp32")
    assert kernels["_mla_paged_combine_kernel"].arg_names == ("cu_seqlens", "NSPLIT", "part_acc", "part_ml", "o")
    for k in kernels.values():
        assert k.sm == 90 and k.cubin[:4] == b"\x7fELF"
        assert k.block[0] == 32 * k.num_warps and 0 <= k.shared <= 227 * 1024
