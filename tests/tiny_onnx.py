"""A tiny module calling k3 ops, through torch.export and torch.onnx with bare k3 nodes (batch and sequence
dynamic), and the `ort` flavor of it as an ONNX Runtime CPU session: the op families' export tests."""

from __future__ import annotations

import onnx_ir as ir
import torch


def export_k3(model: torch.nn.Module, example: torch.Tensor) -> ir.Model:
    """`model(example)` ([B, T, ...]) exported with B <= 64 and T <= 1024 dynamic; the k3 nodes bare."""
    from k3x.exporter.onnx import translation_table

    dims = {"x": {0: torch.export.Dim("B", max=64), 1: torch.export.Dim("T", max=1024)}}
    ep = torch.export.export(model, (example,), dynamic_shapes=dims)
    return torch.onnx.export(ep, dynamo=True, custom_translation_table=translation_table(), optimize=False,
                             opset_version=23).model


def ort_flavor_session(onnx_model: ir.Model):
    """(the `ort` flavor of a copy of `onnx_model`, serialised; an ONNX Runtime CPU session over it)."""
    import onnxruntime as ort

    from k3x.exporter.onnx_flavors import ort_pass

    proto = ir.serde.serialize_model(ort_pass(ir.serde.deserialize_model(ir.serde.serialize_model(onnx_model))))
    return proto, ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
