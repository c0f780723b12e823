from .op import kda_prep, kda_prep_output_shapes

__all__ = ["kda_prep", "kda_prep_output_shapes"]
