from .op import mla_paged, mla_paged_output_shape

__all__ = ["mla_paged", "mla_paged_output_shape"]
