"""The one dtype table: k3x dtype names and what each is in torch, Triton and bytes.

Every other module (artifacts, CLI, runners, plugins, launch plans) names dtypes by these strings and
converts through the functions here. Torch is imported lazily so TensorRT-side code can use the table on a
machine without torch.
"""

from __future__ import annotations

from typing import Any

ITEMSIZE: dict[str, int] = {"fp32": 4, "fp16": 2, "bf16": 2, "int32": 4, "int64": 8, "uint8": 1, "int8": 1}
FLOAT: tuple[str, ...] = ("fp32", "fp16", "bf16")  # float dtypes a model may be exported in
TRITON_POINTER: dict[str, str] = {"fp32": "*fp32", "fp16": "*fp16", "bf16": "*bf16", "int32": "*i32",
                                  "int64": "*i64", "uint8": "*u8", "int8": "*i8"}
ONNX_TYPES: dict[str, str] = {"fp32": "tensor(float)", "fp16": "tensor(float16)", "bf16": "tensor(bfloat16)",
                             "int32": "tensor(int32)", "int64": "tensor(int64)", "uint8": "tensor(uint8)",
                             "int8": "tensor(int8)"}
_TORCH_ATTR = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16", "int32": "int32", "int64": "int64",
               "uint8": "uint8", "int8": "int8"}


def torch_dtype(name: str) -> Any:
    """`torch.dtype` of a k3x dtype name; ValueError naming the choices otherwise."""
    import torch

    if name not in _TORCH_ATTR:
        raise ValueError(f"dtype {name!r}: choose from {sorted(_TORCH_ATTR)}")
    return getattr(torch, _TORCH_ATTR[name])


def dtype_name(dtype: Any) -> str:
    """k3x name of a `torch.dtype` (or of a name already)."""
    if isinstance(dtype, str) and dtype in _TORCH_ATTR:
        return dtype
    for name, attr in _TORCH_ATTR.items():
        if str(dtype) == f"torch.{attr}":
            return name
    raise ValueError(f"dtype {dtype}: k3x handles {sorted(_TORCH_ATTR)}")
