"""The TensorRT 11 QDP `aot_impl` body, driven with a stand-in for `tensorrt.plugin` (TensorRT 11 cannot be
installed here): it must compile the AttnRes kernel for sm_90 and return (name, PTX, launch params, scalars)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("triton")


class _Params:  # trtp.KernelLaunchParams
    pass


FAKE_TRTP = SimpleNamespace(KernelLaunchParams=_Params, SymInt32=lambda v: ("i32", v),
                            SymIntExprs=SimpleNamespace(from_tuple=lambda xs: tuple(xs)))


def desc(dtype: str, shape: list[int]):
    return SimpleNamespace(dtype=SimpleNamespace(name=dtype), shape_expr=shape)


def test_attn_res_aot_impl_body_compiles_sm90():
    from k3x.custom_ops.attn_res.plugin import SPEC
    from k3x.plugins import qdp

    d = 64
    ins = [desc("FLOAT", [2, 3, d]), desc("FLOAT", [2, 3, 2, d]), desc("FLOAT", [d]), desc("FLOAT", [d])]
    name, ptx, params, extra = qdp.aot(FAKE_TRTP, SPEC, ins, [desc("FLOAT", [2, 3, d])],
                                       {"eps": 1e-5, "hidden_size": d}, 90, {"R": 6, "N": 2, "d": d})
    assert name == b"_attn_res_kernel" and b".target sm_90" in ptx
    assert params.grid_x >= 1 and params.block_x % 32 == 0 and params.shared_mem >= 0
    assert all(kind == "i32" for kind, _ in extra)
