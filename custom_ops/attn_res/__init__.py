from .op import attn_res, attn_res_output_shape

__all__ = ["attn_res", "attn_res_output_shape"]
