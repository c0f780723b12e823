"""Adding an op family is one folder plus one registry line: a throwaway family `toy` (y = scale · x) is
written into a temporary folder, made part of `k3x.custom_ops`, and named in FAMILIES; with no other change
the ONNX translation table, the flavor passes (ONNX Runtime runs its body), the plugin specs and config
validation all pick it up."""

from __future__ import annotations

import sys
import textwrap

import numpy as np
import pytest
import torch

import k3x.custom_ops as custom_ops
from k3x.custom_ops import registry

FILES = {
    "__init__.py": "",
    "op.py": '''
        from k3x.plan.signature import KERNELS, Attr, Signature, TensorPort

        def check_config(cfg, *, kernels: bool):
            return "toy: refuses rms_norm_eps=0.5" if cfg.rms_norm_eps == 0.5 else None

        SIGNATURE = Signature("toy", "Toy", inputs=(TensorPort("x", "T"),), outputs=(TensorPort("y", "T", "x"),),
                              attrs=(Attr("scale", float), KERNELS), shapes=lambda s: [s[0]], doc="y = scale * x")

        @SIGNATURE.define
        def _toy(x, scale, kernels):
            return x * scale
    ''',
    "reference.py": "def toy(x, scale):\n    return x * scale\n",
    "triton.py": '''
        import triton
        import triton.language as tl
        from k3x.plan.launch import Launch, Plan, Variant, cdiv

        @triton.jit
        def _toy_kernel(x, y, n, scale, BLOCK: tl.constexpr):
            o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
            tl.store(y + o, tl.load(x + o, mask=o < n) * scale, mask=o < n)

        def dims(shapes):
            n = 1
            for d in shapes[0]:
                n = d * n
            return {"n": n}

        def plan(d, dtypes, attrs):
            launch = Launch(_toy_kernel, ("x", "y", "n"), {"scale": float(attrs["scale"]), "BLOCK": 128},
                            grid=lambda x: (cdiv(x["n"], 128), 1, 1), scalars=lambda x: {"n": x["n"]})
            return Plan((Variant("all", (launch,)),))
    ''',
    "onnx.py": '''
        import onnx
        from .op import SIGNATURE
        from k3x.plan.onnx_node import COMMON_ATTRIBUTES, Body, NodeSpec, opset

        NODE = NodeSpec.of(SIGNATURE)
        NODE.register()

        def translate(x, scale: float, kernels: str):
            return opset().Toy(x, scale=float(scale), **COMMON_ATTRIBUTES)

        def function(opset_version, nodes):
            b = Body("Toy", "scale")
            b.out("Mul", ["x", b.op("CastLike", b.ref("scale", onnx.AttributeProto.FLOAT, "value_float"), "x")], ["y"])
            return b.function(NODE, {"": opset_version}), {}
    ''',
    "plugin.py": '''
        from . import triton as kt
        from .op import SIGNATURE
        from k3x.plugins.core import PluginSpec

        SPEC = PluginSpec.of(SIGNATURE, dims=kt.dims, check=lambda shapes, attrs: None, plan=kt.plan)
    ''',
}


@pytest.fixture(scope="module")
def toy_family(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    for name, text in FILES.items():
        (root / "toy").mkdir(exist_ok=True)
        (root / "toy" / name).write_text(textwrap.dedent(text))
    custom_ops.__path__.append(str(root))  # the folder, as if it sat in custom_ops/
    saved = registry.FAMILIES
    registry.FAMILIES = saved + ("toy",)  # the one registry line
    yield registry.Family("toy")
    registry.FAMILIES = saved
    custom_ops.__path__.remove(str(root))
    for m in [m for m in sys.modules if m.startswith("k3x.custom_ops.toy")]:
        del sys.modules[m]


class Toy(torch.nn.Module):
    def forward(self, x):
        return torch.ops.k3.toy(x, 3.0, "reference")


def test_new_family_reaches_every_stage(toy_family):
    import onnx_ir as ir
    import onnxruntime as ort

    from k3x.custom_ops.trt_plugins import specs
    from k3x.exporter.onnx import translation_table
    from k3x.exporter.onnx_collectives import translation_table as collectives
    from k3x.exporter.onnx_flavors import ort_pass, trt_pass
    from k3x.model.config import ConfigError, preset

    toy_family.op  # noqa: B018  (registers torch.ops.k3.toy)
    table = translation_table()
    assert toy_family.overload in table and len(table) == len(registry.FAMILIES) + len(collectives())
    ep = torch.export.export(Toy(), (torch.randn(2, 5),))
    model = torch.onnx.export(ep, dynamo=True, custom_translation_table=table, optimize=False, opset_version=23).model
    assert [n.op_type for n in model.graph if n.domain == "k3"] == ["Toy"]
    trt_pass(model)  # attributes complete
    ort_pass(model)  # the family's body attached
    x = np.random.default_rng(0).standard_normal((2, 5)).astype(np.float32)
    sess = ort.InferenceSession(ir.serde.serialize_model(model).SerializeToString(), providers=["CPUExecutionProvider"])
    np.testing.assert_allclose(sess.run(None, {sess.get_inputs()[0].name: x})[0], 3.0 * x, rtol=1e-6)
    assert specs()["Toy"].fields[0].name == "scale"
    import dataclasses

    with pytest.raises(ConfigError, match="toy: refuses rms_norm_eps=0.5"):
        dataclasses.replace(preset("k3-mini"), rms_norm_eps=0.5)
