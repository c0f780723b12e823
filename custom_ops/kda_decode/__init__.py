from .op import KDADecodeOutput, kda_decode, kda_decode_, kda_decode_output_shapes

__all__ = ["KDADecodeOutput", "kda_decode", "kda_decode_", "kda_decode_output_shapes"]
