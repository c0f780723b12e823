"""k3::attn_res's CUDA candidates and their pick (plan/dispatch.py): the kernel's launch entries.

One dispatched op, `attn_res.mix`, classes by dtype, sources N + 1 and rows R (<= 1, 64, 1K, 8K, more): `k3x` (the
tile chosen by `triton.attn_res_launch_config`) and `k3x-VxW` for each (tile values V = NS·BD, W warps) of
`triton.ENTRIES`. The first H200 run found the 8-source mix at 6 % of the copy ceiling with the default tile
and one source at 65 %: the tile is the first thing to measure. Default order (no table): `k3x`.
"""

from __future__ import annotations

from torch import Tensor

from ...plan.dispatch import Candidate, bucket
from ...plan.dtypes import dtype_name
from ..dispatch import DISPATCH
from . import triton

MIX = "attn_res.mix"
ROWS = (1, 64, 1024, 8192)


def shape_class(R: int, N: int, dtype) -> str:
    return f"{dtype_name(dtype)}-S{N + 1}-{bucket(R, ROWS, 'R')}"


def _entry(entry: tuple[int, int] | None):
    def run(prefix, bank, norm_weight, proj_weight, eps):
        return triton.attn_res(prefix, bank, norm_weight, proj_weight, eps, entry=entry)
    return run


CANDIDATES = (Candidate("k3x", _entry(None)),
              *(Candidate("k3x-{}x{}".format(*e), _entry(e)) for e in triton.ENTRIES))
DEFAULT = ("k3x",)


def attn_res(prefix: Tensor, bank: Tensor, norm_weight: Tensor, proj_weight: Tensor, eps: float) -> Tensor:
    """k3::attn_res on CUDA tensors: the picked launch entry for this shape class."""
    R = prefix.numel() // max(prefix.shape[-1], 1)
    c = DISPATCH.pick(MIX, shape_class(R, bank.shape[-2], prefix.dtype), CANDIDATES, DEFAULT)
    return c.run(prefix, bank, norm_weight, proj_weight, eps)
