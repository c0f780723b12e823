from .op import KDAPackedOutput, kda_packed, kda_packed_output_shapes

__all__ = ["KDAPackedOutput", "kda_packed", "kda_packed_output_shapes"]
