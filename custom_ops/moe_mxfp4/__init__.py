from .op import moe_mxfp4

__all__ = ["moe_mxfp4"]
