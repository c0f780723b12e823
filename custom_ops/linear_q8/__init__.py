from .op import linear_q8

__all__ = ["linear_q8"]
