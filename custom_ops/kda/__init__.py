from .op import KDAOutput, kda, kda_output_shapes

__all__ = ["KDAOutput", "kda", "kda_output_shapes"]
