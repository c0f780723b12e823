"""k3::KDAPacked plugin spec on CPU: the op's shape rule, shape and dtype checks naming the tensor, and the AOT
kernels for sm_90 (kda's kernels in packed mode: QDP argument order, both variants, workspace sized by N)."""

from __future__ import annotations

import pytest

from k3x.custom_ops.kda_packed import kda_packed_output_shapes
from k3x.custom_ops.kda_packed.plugin import SPEC
from k3x.plan.launch import workspace_layout
from k3x.plugins import PluginError
from k3x.plugins.adapter import compile_plan

ATTRS = {"num_heads": 3, "head_dim": 16, "value_dim": 32, "scale": 0.25, "gate_lower_bound": -5.0}
# q k v g beta state_pool cu_seqlens slots -> o final_state
TYPES = ["bf16"] * 3 + ["fp32"] * 3 + ["int32"] * 2 + ["bf16", "fp32"]
DIMS = [dict(N=1, B=1, H=3, K=16, V=32), dict(N=300, B=8, H=3, K=16, V=32), dict(N=4096, B=64, H=3, K=16, V=32)]


def shapes(N=9, B=3, S=5, H=3, K=16, V=32):
    return [[N, H, K], [N, H, K], [N, H, V], [N, H, K], [N, H], [S, H, K, V], [B + 1], [B]]


def test_shape_rule_is_the_ops():
    s = shapes()
    assert SPEC.output_shapes(s) == list(kda_packed_output_shapes(s[0], s[2], s[7])) == [(9, 3, 32), (3, 3, 16, 32)]


@pytest.mark.parametrize("i,bad,named", [
    (4, [9, 2], "beta"),
    (5, [5, 3, 16, 16], "state_pool"),
    (6, [3], "cu_seqlens"),
    (2, [9, 4, 32], "v[:2]"),
    (7, [3, 1], "ranks"),
])
def test_shape_checks_name_the_tensor(i, bad, named):
    s = shapes()
    assert SPEC.check(s, ATTRS) is None
    s[i] = bad
    reason = SPEC.check(s, ATTRS)
    assert reason and named in reason


def test_checks_fields_and_kernel_limits_and_unknown_dims():
    assert "num_heads=4" in SPEC.check(shapes(), ATTRS | {"num_heads": 4})
    assert "16 <= K, V <= 256" in SPEC.check(shapes(K=8), ATTRS | {"head_dim": 8})
    unknown = [[None, 3, 16], [None, 3, 16], [None, 3, 32], [None, 3, 16], [None, 3], [None, 3, 16, 32], [None],
               [None]]
    assert SPEC.check(unknown, ATTRS) is None  # dynamic dims are unknown at shape-function time: not an error


def test_formats_enforced():
    SPEC.check_dtypes(TYPES)
    with pytest.raises(PluginError, match="'cu_seqlens' has dtype int64, supported: int32"):
        SPEC.check_dtypes(TYPES[:6] + ["int64"] + TYPES[7:])
    with pytest.raises(PluginError, match="'state_pool' has dtype bf16, supported: fp32"):
        SPEC.check_dtypes(TYPES[:5] + ["bf16"] + TYPES[6:])
    assert not SPEC.supports(8, TYPES[:8] + ["fp16", "fp32"])  # o must match v


def test_aot_kernels_sm90():
    plan = SPEC.plan(DIMS[1], TYPES, ATTRS)
    kernels = compile_plan(SPEC, plan, TYPES, 90, DIMS)
    names = sorted(k.name for k in kernels)
    assert names == ["_kda_intra_kernel", "_kda_recurrent_kernel", "_kda_recurrent_kernel", "_kda_state_kernel"]
    rec = next(k for k in kernels if k.name == "_kda_recurrent_kernel")  # QDP order: inputs, int32 scalars, outputs
    assert rec.arg_names == ("q", "k", "v", "g", "beta", "state_pool", "cu_seqlens", "slots", "T", "o", "final_state")
    assert rec.arg_types == ("*bf16",) * 3 + ("*fp32",) * 3 + ("*i32", "*i32", "i32", "*bf16", "*fp32")
    for k in kernels:
        assert k.sm == 90 and k.cubin[:4] == b"\x7fELF" and k.n_params == len(k.arg_names) + 2
    assert plan.select(dict(N=64, B=64)).name == "recurrent"  # decode only
    assert plan.select(dict(N=79, B=64)).name == "recurrent"  # 63 one-row sequences + one of 16 at most
    assert plan.select(dict(N=80, B=64)).name == "mixed"  # one may have 17
    mixed = plan.select(DIMS[2])
    assert [x.kernel_name for x in mixed.launches] == ["_kda_recurrent_kernel", "_kda_intra_kernel",
                                                         "_kda_state_kernel"]
    assert mixed.launches[1].grid(DIMS[2]) == (64, 64 * 3, 1)  # cdiv(N, 64) chunks x B*H
    offsets, total = workspace_layout(plan.workspace, DIMS[2])
    assert total >= 4096 * 3 * (3 * 16 + 32 + 64) * 2 + 4096 * 3 * 16 * 4  # w u qg kg A (bf16) + gl (fp32), N rows
