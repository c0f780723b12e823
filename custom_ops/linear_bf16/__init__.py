from .op import linear_bf16

__all__ = ["linear_bf16"]
