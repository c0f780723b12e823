"""Symbolic shapes carried from a block's own trace into the full program's (exporter/stamp.py).

A block template is traced by `torch.export` on its own, so its node values (`meta["val"]`) hold symbols of
that trace's ShapeEnv. Stamped into the full program they must hold the full program's: `SymbolMap` binds each
template input symbol to the full program's size at that position (a SymInt of its ShapeEnv, or an int where
the full program has a static size, e.g. the AttnRes bank's source count) and rebuilds values from it.
Rebuilt values are memoised on the bound sizes they depend on, so the 69 copies of one block share them.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import sympy
import torch
from torch.fx.passes.shape_prop import _extract_tensor_metadata
from torch.utils._sympy.functions import FloorDiv, Max, Min, Mod, PythonMod


class StampError(RuntimeError):
    """The model has a shape the stamped trace cannot carry over; the per-layer trace is used instead."""


Size = "torch.SymInt | int"


def expr_of(x: Any) -> sympy.Expr | int:
    return x.node.expr if isinstance(x, torch.SymInt) else int(x)


def _evaluate(e: sympy.Expr | int, env: dict[sympy.Symbol, Any]) -> Any:
    """`e` with every symbol replaced by its bound size, computed with SymInt arithmetic."""
    if isinstance(e, int):
        return e
    if e.is_Integer:
        return int(e)
    if e.is_Symbol:
        if e not in env:
            raise StampError(f"stamped trace: symbol {e} of a block is not bound to an input size")
        return env[e]
    args = [_evaluate(a, env) for a in e.args]
    if isinstance(e, sympy.Add):
        return sum(args[1:], args[0])
    if isinstance(e, sympy.Mul):
        return math.prod(args[1:], start=args[0])
    if isinstance(e, FloorDiv):
        return args[0] // args[1]
    if isinstance(e, (Mod, PythonMod)):
        return args[0] % args[1]
    if isinstance(e, (Max, sympy.Max)):
        return _fold(torch.sym_max, args)
    if isinstance(e, (Min, sympy.Min)):
        return _fold(torch.sym_min, args)
    raise StampError(f"stamped trace: cannot carry the size expression {e} ({type(e).__name__}) over")


def _fold(fn: Callable, args: list) -> Any:
    out = args[0]
    for a in args[1:]:
        out = fn(out, a)
    return out


def free_symbols(v: Any) -> frozenset:
    """The symbols a node value's sizes, strides or value depend on."""
    if isinstance(v, torch.Tensor):
        syms = set()
        for x in (*v.shape, *v.stride(), v.storage_offset()):
            if isinstance(x, torch.SymInt):
                syms |= x.node.expr.free_symbols
        return frozenset(syms)
    if isinstance(v, torch.SymInt):
        return frozenset(v.node.expr.free_symbols)
    if isinstance(v, (list, tuple)):
        return frozenset().union(*(free_symbols(x) for x in v)) if v else frozenset()
    return frozenset()


class SymbolMap:
    """Template symbols bound to the full program's sizes; rebuilds template node values in its fake mode."""

    def __init__(self, fake_mode: Any, env: dict[sympy.Symbol, Any]) -> None:
        self.fake_mode, self.env = fake_mode, env

    @classmethod
    def bind(cls, fake_mode: Any, template_vals: list[Any], actual: list[Any]) -> SymbolMap:
        """Bind by position: template input tensors against the values at the same positions in the full
        program (a template size that is an expression rather than a symbol must agree, else StampError)."""
        env: dict[sympy.Symbol, Any] = {}
        for t, a in zip(template_vals, actual, strict=True):
            if (t is None) != (a is None):
                raise StampError("stamped trace: a block input is None in one trace and a tensor in the other")
            if t is None:
                continue
            if t.dim() != a.dim():
                raise StampError(f"stamped trace: a block input has rank {t.dim()} here, {a.dim()} in the model")
            for ts, size in zip(t.shape, a.shape):
                e = expr_of(ts)
                if isinstance(e, sympy.Symbol):
                    env.setdefault(e, size)
        return cls(fake_mode, env)

    def key(self, symbols: frozenset) -> tuple:
        """What a value depending on `symbols` is memoised on: the bound sizes (ints, or SymInt expressions)."""
        return tuple((s.name, str(expr_of(self.env[s])) if s in self.env else None)
                     for s in sorted(symbols, key=lambda s: s.name))

    def size(self, x: Any) -> Any:
        return _evaluate(expr_of(x), self.env)

    def value(self, v: Any) -> Any:
        """A template node value rebuilt with the bound sizes (tensors as fake tensors of the full program)."""
        if isinstance(v, torch.Tensor):
            sizes, strides = [self.size(s) for s in v.shape], [self.size(s) for s in v.stride()]
            if all(type(x) is int for x in (*sizes, *strides)):  # static (every weight): a meta tensor wrapped
                meta = torch.empty_strided(sizes, strides, dtype=v.dtype, device="meta")
                fake = self.fake_mode.fake_tensor_converter.from_meta_and_device(self.fake_mode, meta, v.device)
                return fake.requires_grad_(v.requires_grad)
            with self.fake_mode:
                return torch.empty_strided(sizes, strides, dtype=v.dtype, device=v.device,
                                           requires_grad=v.requires_grad)
        if isinstance(v, torch.SymInt):
            return self.size(v)
        if isinstance(v, (list, tuple)):
            return type(v)(self.value(x) for x in v)
        if isinstance(v, (torch.SymFloat, torch.SymBool)):
            raise StampError(f"stamped trace: a block computes a symbolic {type(v).__name__}")
        return v


def tensor_meta(v: Any, like: Any = None) -> Any:
    """`meta["tensor_meta"]` as torch.export records it for a value; `like`: the template node's, whose
    `requires_grad` is kept (torch records a parameter's views as requiring grad, their values as not)."""
    if isinstance(v, torch.Tensor):
        tm = _extract_tensor_metadata(v)
        return tm if like is None else tm._replace(requires_grad=like.requires_grad)
    if isinstance(v, (list, tuple)):
        likes = like if isinstance(like, (list, tuple)) and len(like) == len(v) else [None] * len(v)
        return type(v)(tensor_meta(x, y) for x, y in zip(v, likes))
    return None
