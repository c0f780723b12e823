"""The TensorRT 11 QDP functions are made from each plugin spec, not typed by hand. TensorRT 11 cannot be
installed here, so `Trtp` stands in for `tensorrt.plugin`: its decorators check what TensorRT's
`_validate.py` checks through `inspect.signature` (annotations are classes, TensorDescs first, attributes
typed int|float|str|bool|bytes without defaults, the exact parameter order of autotune/impl/aot_impl, the
return annotations), and the functions are then called the way TensorRT's plugin class calls them."""

from __future__ import annotations

import inspect
import typing

import pytest

from k3x.custom_ops.trt_plugins import specs
from k3x.plugins import PluginSpec, qdp

ATTR_TYPES = (int, float, bytes, bool, str)


class TensorDesc:
    pass


class Tensor:
    pass


class KernelLaunchParams:
    pass


class SymIntExprs:
    pass


class AutoTuneCombination:
    def __init__(self) -> None:
        self.types: dict[int, str] = {}

    def pos(self, i: int, types: str) -> None:
        self.types[i] = types


def params(fn) -> list[inspect.Parameter]:
    return list(inspect.signature(fn).parameters.values())


class Trtp:
    """`tensorrt.plugin`'s decorators with its signature checks; `registered[op][kind]` = the function."""
    TensorDesc, Tensor, KernelLaunchParams, SymIntExprs, AutoTuneCombination = (
        TensorDesc, Tensor, KernelLaunchParams, SymIntExprs, AutoTuneCombination)

    def __init__(self) -> None:
        self.registered: dict[str, dict] = {}

    def _add(self, kind: str, op: str, check):
        def deco(fn):
            check(op, fn)
            self.registered.setdefault(op, {})[kind] = fn
            return fn
        return deco

    def register(self, op):
        def check(op, fn):
            seen_attr, attrs = False, {}
            for p in params(fn):
                assert inspect.isclass(p.annotation), f"{p.name}: annotation {p.annotation!r} is not a class"
                assert p.default is inspect.Parameter.empty, f"{p.name} has a default"
                if issubclass(p.annotation, TensorDesc):
                    assert not seen_attr, "TensorDescs and attributes interspersed"
                else:
                    assert p.annotation in ATTR_TYPES and p.name not in ("outputs", "stream", "tactic")
                    seen_attr, attrs[p.name] = True, p.annotation
            ret = inspect.signature(fn).return_annotation
            outs = typing.get_args(ret) if typing.get_origin(ret) is tuple else (ret,)
            assert all(inspect.isclass(o) and issubclass(o, TensorDesc) for o in outs)
            self.attrs = attrs
        return self._add("register", op, check)

    def _schema(self, op, fn, tensor_cls, tail):
        reg = params(self.registered[op]["register"])
        tensors = [p.name for p in reg if issubclass(p.annotation, TensorDesc)]
        got = params(fn)
        for p in got:
            if p.name in self.attrs and p.annotation is not inspect.Parameter.empty:
                assert p.annotation == self.attrs[p.name], f"{p.name}: type differs from register's"
            elif p.name in tensors:
                assert issubclass(p.annotation, tensor_cls)
        names = [p.name for p in got]
        assert names == tensors + [n for n in self.attrs if n in names] + tail, names

    def autotune(self, op):
        def check(op, fn):
            self._schema(op, fn, TensorDesc, ["outputs"])
        return self._add("autotune", op, check)

    def impl(self, op):
        def check(op, fn):
            self._schema(op, fn, Tensor, ["outputs", "stream"])
            assert inspect.signature(fn).return_annotation in (None, inspect.Signature.empty)
        return self._add("impl", op, check)

    def aot_impl(self, op):
        def check(op, fn):
            self._schema(op, fn, TensorDesc, ["outputs", "tactic"])
            ret = typing.get_args(inspect.signature(fn).return_annotation)
            assert len(ret) == 4 and ret[2] is KernelLaunchParams and ret[3] is SymIntExprs
            assert all(set(typing.get_args(r)) == {str, bytes} for r in ret[:2])
        return self._add("aot_impl", op, check)


@pytest.mark.parametrize("name", sorted(specs()))
def test_qdp_functions_pass_tensorrts_checks(name):
    spec: PluginSpec = specs()[name]
    trtp = Trtp()
    qdp.register(trtp, spec, sm=90, opt_dims={})
    fns = trtp.registered[f"k3::{name}"]
    want = {"register", "autotune", "impl"} | ({"aot_impl"} if spec.qdp_aot_dims is not None else set())
    assert set(fns) == want
    reg = params(fns["register"])
    assert [p.name for p in reg] == [p.name for p in spec.inputs] + [f.name for f in spec.fields]
    assert [p.annotation for p in reg[len(spec.inputs):]] == [f.kind for f in spec.fields]
    n_out = len(spec.outputs)
    ret = inspect.signature(fns["register"]).return_annotation
    assert (ret is TensorDesc) if n_out == 1 else typing.get_args(ret) == (TensorDesc,) * n_out


def test_qdp_functions_call_the_bodies_as_tensorrt_calls_them(monkeypatch):
    """register(*descs, **attrs), impl(*tensors, *attrs, outputs, stream=), aot_impl(*descs, *attrs, outputs,
    tactic): each reaches its body with the ports in order and every field by name."""
    spec = specs()["KDA"]
    calls = {}
    monkeypatch.setattr(qdp, "output_descs", lambda trtp, s, descs, attrs: calls.setdefault("desc", (descs, attrs)))
    monkeypatch.setattr(qdp, "jit", lambda s, ins, outs, attrs, stream: calls.setdefault("jit", (ins, outs, attrs, stream)))
    monkeypatch.setattr(qdp, "aot", lambda trtp, s, ins, outs, attrs, sm, dims: calls.setdefault("aot", (attrs, sm, dims)))
    trtp = Trtp()
    qdp.register(trtp, spec, sm=90, opt_dims={"B": 1, "T": 64})
    fns = trtp.registered["k3::KDA"]
    ins = [f"t{i}" for i in range(len(spec.inputs))]
    attrs = {"scale": 0.25, "num_heads": 2, "head_dim": 16, "value_dim": 32, "gate_lower_bound": -5.0}
    fns["register"](*ins, **attrs)
    assert calls["desc"] == (ins, attrs)
    fns["impl"](*ins, *attrs.values(), ("o", "s"), stream=7)
    assert calls["jit"] == (ins, ["o", "s"], attrs, 7)
    fns["aot_impl"](*ins, *attrs.values(), ("o", "s"), 0)
    assert calls["aot"] == (attrs, 90, {"B": 1, "T": 1})  # KDA's aot_impl pins the recurrent kernel (T = 1)
    [combination] = fns["autotune"](*ins, ("o", "s"))
    assert combination.types[0] == "FP32|FP16|BF16" and combination.types[3] == "FP32" and len(combination.types) == 8


def test_the_stand_in_refuses_what_tensorrt_refuses():
    """The checks above can fail: a hand-typed function in a module with `from __future__ import annotations`
    (this one) has string annotations, which TensorRT cannot check; a defaulted attribute is refused."""
    trtp = Trtp()

    def hand_typed(x: TensorDesc, n: int) -> TensorDesc:
        return x

    with pytest.raises(AssertionError, match="not a class"):
        trtp.register("k3::Bad")(hand_typed)
    P = inspect.Parameter
    hand_typed.__signature__ = inspect.Signature(
        [P("x", P.POSITIONAL_OR_KEYWORD, annotation=TensorDesc), P("n", P.POSITIONAL_OR_KEYWORD, annotation=int,
                                                                  default=1)], return_annotation=TensorDesc)
    with pytest.raises(AssertionError, match="has a default"):
        trtp.register("k3::Bad")(hand_typed)
