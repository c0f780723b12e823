"""The registry of op families: the one list every stage iterates instead of naming ops.

    FAMILIES = ("kda", "attn_res", "moe", ...)      # one entry per family: its folder under custom_ops/

A family folder `custom_ops/<name>/` has fixed roles (docs/architecture.md):
    op.py         `SIGNATURE` (plan/signature.py: ports, dtypes, attributes, shape rule; it makes the
                  torch schema and fake impl, the ONNX node spec, the plugin ports and the QDP functions),
                  the torch op `k3::<name>`, `check_config` (limits)
    reference.py  PyTorch reference (fp32 oracle)
    triton.py     Triton kernels and their launch plan (`dims`, `plan`, torch launchers)
    onnx.py       `NODE` (ONNX node spec), `translate` (torch.onnx), `function` (ONNX Runtime body)
    plugin.py     `SPEC` (TensorRT plugin spec: the signature's ports plus shape check and launch plan)
Roles other than op.py are imported only when asked for (`family.onnx`, `family.plugin`, `family.triton`),
so torch-only use never imports onnx, Triton or TensorRT.

A family in `CPU_ONLY` runs on ONNX Runtime's CPU provider (its function body, or its `ort_kernel.cc`) and in
torch, and nowhere else: it has no triton.py and no plugin.py (tests/test_layout.py checks both ways), the
TensorRT plugin registration skips it and the trt flavor refuses its nodes. `check_config` in op.py is
optional for such a family (a family with no limits has none).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Iterator

FAMILIES: tuple[str, ...] = ("kda", "attn_res", "moe", "moe_mxfp4", "kda_packed", "mla_paged", "kda_decode",
                             "kda_prep", "linear_bf16", "linear_q8")
CPU_ONLY: tuple[str, ...] = ("linear_bf16", "linear_q8")  # no Triton kernel, no TensorRT plugin (module docstring)


@dataclass(frozen=True)
class Family:
    name: str  # folder name = custom-op name: torch.ops.k3.<name>

    def role(self, role: str) -> ModuleType:
        return importlib.import_module(f"{__package__}.{self.name}.{role}")

    @property
    def op(self) -> ModuleType:
        return self.role("op")

    @property
    def onnx(self) -> ModuleType:
        return self.role("onnx")

    @property
    def plugin(self) -> ModuleType:
        return self.role("plugin")

    @property
    def triton(self) -> ModuleType:
        return self.role("triton")

    @property
    def gpu(self) -> bool:
        """Whether the family has the GPU roles (triton.py, plugin.py): every family not in CPU_ONLY."""
        return self.name not in CPU_ONLY

    @property
    def qualname(self) -> str:  # as in op counts: "k3::kda"
        return f"k3::{self.name}"

    @property
    def overload(self):
        import torch

        return getattr(torch.ops.k3, self.name).default


def families() -> Iterator[Family]:
    return (Family(n) for n in FAMILIES)


def by_onnx_op(op_type: str) -> Family:
    """The family whose ONNX node is `k3::<op_type>` (e.g. "KDA")."""
    for f in families():
        if f.onnx.NODE.op_type == op_type:
            return f
    raise KeyError(f"unknown ONNX op k3::{op_type} (known: {[f.onnx.NODE.op_type for f in families()]})")


def check_config(cfg: Any, *, kernels: bool, packed_experts: bool = False) -> str | None:
    """The first reason any family's op cannot run `cfg` (a model config, read duck-typed: the op families sit
    below model/, which calls this), or None. `kernels=True` adds the Triton kernel
    (and TensorRT plugin) limits; the reference limits always apply. `packed_experts`: k3::moe_mxfp4 too."""
    for f in families():
        if f.name == "moe_mxfp4" and not packed_experts:
            continue
        check = getattr(f.op, "check_config", None)  # optional for a CPU_ONLY family
        reason = check(cfg, kernels=kernels) if check is not None else None
        if reason:
            return reason
    return None
