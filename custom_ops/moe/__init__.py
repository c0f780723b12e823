from .op import MoEOptions, moe, moe_output_shape

__all__ = ["MoEOptions", "moe", "moe_output_shape"]
