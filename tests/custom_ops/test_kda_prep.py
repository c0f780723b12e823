"""k3::kda_prep: the op and its TensorRT plugin (plugin.py)."""

from __future__ import annotations

import operator
import sys
from types import SimpleNamespace

import pytest

import k3x.custom_ops  # noqa: F401  (registers torch.ops.k3.*)

# ---- TensorRT plugin: the shape check names the bad port; the shape rule on TensorRT's shape expressions ----

# H = 2, K = V = 16 (C = 96), W = 4, N = 5 rows, B = 2 sequences, S = 6 pool rows
PLUGIN_SHAPES = [(5, 96), (5, 2, 16), (5, 2), (96, 4), (3,), (32,), (6, 96, 3), (3,), (2,)]
PLUGIN_ATTRS = {"num_heads": 2, "head_dim": 16, "value_dim": 16, "conv_kernel": 4, "gate_lower_bound": -5.0}


def test_plugin_check_accepts_concrete_and_unknown_dims():
    from k3x.custom_ops.kda_prep.plugin import SPEC

    assert SPEC.check(PLUGIN_SHAPES, PLUGIN_ATTRS) is None
    unknown = [[None, 96], [None, 2, 16], [None, 2], [96, 4], [3], [32], [None, 96, 3], [None], [None]]
    assert SPEC.check(unknown, PLUGIN_ATTRS) is None  # dynamic dims are unknown at shape-function time
    assert SPEC.check(unknown, {}) is None
    assert SPEC.dims(PLUGIN_SHAPES) == {"N": 5, "B": 2, "H": 2, "K": 16, "V": 16, "W": 4}


@pytest.mark.parametrize("changes, attrs, reason", [
    ({0: (5, 95)}, {}, "qkv has shape [5, 95]"),  # not a whole V per head
    ({0: (4, 96)}, {}, "qkv[0] has shape [4]"),
    ({2: (5, 3)}, {}, "b has shape [5, 3]"),
    ({4: (1,)}, {}, "A_log has shape [1], expected at least H=2"),
    ({5: (16,)}, {}, "dt_bias has shape [16]"),
    ({6: (6, 96, 2)}, {}, "conv_pool[1:] has shape [96, 2]"),
    ({7: (2,)}, {}, "cu_seqlens has shape [2]"),
    ({8: (2, 1)}, {}, "ranks qkv, f, b"),
    ({}, {"value_dim": 32}, "field value_dim=32"),
    ({}, {"conv_kernel": 3}, "field conv_kernel=3"),
    ({1: (5, 2, 8), 5: (16,)}, {"head_dim": 8, "value_dim": 32}, "needs 16 <= K, V <= 256"),  # C = 96: V = 32
])
def test_plugin_check_names_the_bad_port(changes, attrs, reason):
    from k3x.custom_ops.kda_prep.plugin import SPEC

    shapes = [changes.get(i, s) for i, s in enumerate(PLUGIN_SHAPES)]
    got = SPEC.check(shapes, PLUGIN_ATTRS | attrs)
    assert got is not None and got.startswith(reason), got


class _ShapeExpr:
    """A symbolic dim as TensorRT's QDP ShapeExpr has them: forward operators only; an int inside to check."""

    def __init__(self, n: int):
        self.n = n

    def _op(self, o, op):
        return _ShapeExpr(op(self.n, o.n if isinstance(o, _ShapeExpr) else o))

    def __add__(self, o): return self._op(o, operator.add)
    def __sub__(self, o): return self._op(o, operator.sub)
    def __mul__(self, o): return self._op(o, operator.mul)
    def __floordiv__(self, o): return self._op(o, operator.floordiv)


def test_shape_rule_on_tensorrt_expressions(monkeypatch):
    """V = (C - 2·H·K) // H on both front ends: IPluginV3's `_Sym` over an expression builder (`-` is SUB) and
    QDP's ShapeExprs (no reflected operators: the rule keeps a dim on the left), with builders that compute on ints."""
    from k3x.custom_ops.kda_prep.plugin import SPEC
    from k3x.plugins import adapter, qdp

    want = [(5, 2, 16), (5, 2, 16), (5, 2, 16), (5, 2, 16), (5, 2), (2, 96, 3)]
    ops = {"SUM": operator.add, "SUB": operator.sub, "PROD": operator.mul, "FLOOR_DIV": operator.floordiv}
    builder = SimpleNamespace(trt=SimpleNamespace(DimensionOperation=SimpleNamespace(**{k: k for k in ops})),
                              constant=lambda v: v, operation=lambda op, a, b: ops[op](a, b))
    sym = SPEC.output_shapes([[adapter._Sym(n, builder) for n in s] for s in PLUGIN_SHAPES])
    assert [tuple(d.expr for d in s) for s in sym] == want

    trt = SimpleNamespace(DataType=SimpleNamespace(**{k: k for k in adapter.TRT_DTYPE_NAMES}))
    monkeypatch.setitem(sys.modules, "tensorrt", trt)  # what output_descs reads: the DataType names
    trtp = SimpleNamespace(from_shape_expr=lambda s, dtype: tuple(d.n for d in s))
    descs = [SimpleNamespace(shape_expr=[_ShapeExpr(n) for n in s], dtype=SimpleNamespace(name=t))
             for s, t in zip(PLUGIN_SHAPES, ["FLOAT"] * 7 + ["INT32"] * 2)]
    assert list(qdp.output_descs(trtp, SPEC, descs, PLUGIN_ATTRS)) == want
