"""The CPU trunks' modules (model/trunk.py): which projections convert, what they hold, that a trunk model
computes the fp32 model's function on its rounded weights, and the options that refuse a trunk that cannot be."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from k3x.custom_ops.linear_q8.reference import dequantize
from k3x.model import ConfigError, build_model, empty_state, preset
from k3x.model.options import BuildOptions, ModelOptions
from k3x.model.trunk import BF16Linear, Q8Linear, convert_trunk, trunk_modules
from k3x.runtime.tolerances import tol


def test_the_trunk_is_every_projection_called_as_a_module():
    model = build_model(preset("k3-mini"), seed=0)
    names = trunk_modules(model)
    linear = [n for n, m in model.named_modules() if type(m) is nn.Linear]
    assert "lm_head" in names and any(n.endswith("shared_experts.down_proj") for n in names)
    assert any(n.endswith("routed_expert_down_proj") for n in names) and any(n.endswith("mlp.up_proj") for n in names)
    kept = sorted(set(linear) - set(names))  # read as matrices: the absorbed MLA's kv_b_proj, AttnRes's d -> 1
    assert kept and all(n.endswith(("kv_b_proj", "_res_proj")) for n in kept)


@pytest.mark.parametrize("trunk,cls", [("bf16", BF16Linear), ("int8", Q8Linear)])
def test_a_trunk_model_computes_the_fp32_function_on_its_rounded_weights(trunk, cls):
    """Each converted projection holds the rounded weight; putting the rounded weights back into the fp32 model
    gives the bf16 trunk model's logits (to fp32 rounding): that trunk changes the weights, nothing else. The
    int8 trunk also rounds each projection's input per block (custom_ops/linear_q8/reference.py): close, not equal."""
    cfg = preset("k3-mini")
    dense = build_model(cfg, seed=0)
    form = build_model(cfg, BuildOptions(trunk=trunk), seed=0)
    rounded = build_model(cfg, seed=0)
    names = trunk_modules(dense)
    for name in names:
        m = form.get_submodule(name)
        assert type(m) is cls
        w = m.weight.float() if trunk == "bf16" else dequantize(m.qweight, m.scales, m.in_features)
        assert w.shape == dense.get_submodule(name).weight.shape
        rounded.get_submodule(name).weight.data.copy_(w)
    assert type(form.get_submodule("model.layers.2.self_attn.kv_b_proj")) is nn.Linear
    ids = torch.randint(0, cfg.vocab_size, (1, 6), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got, want = form(ids, empty_state(cfg, 1))[0], rounded(ids, empty_state(cfg, 1))[0]
    if trunk == "bf16":
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    else:
        assert not torch.allclose(got, want, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(got, want, **tol("int8 trunk"))


def test_meta_conversion_gives_the_shapes_a_stream_fills():
    cfg = preset("k3-mini")
    meta = build_model(cfg, BuildOptions(trunk="int8"), device="meta", seed=None)
    real = build_model(cfg, BuildOptions(trunk="int8"), seed=0)
    assert {n: (t.shape, t.dtype) for n, t in meta.state_dict().items()} == \
        {n: (t.shape, t.dtype) for n, t in real.state_dict().items()}
    assert meta.lm_head.qweight.device.type == "meta"


def test_options_record_the_trunk_and_refuse_a_bad_one():
    opts = ModelOptions(BuildOptions(expert_format="mxfp4", trunk="int8"))
    assert opts.to_dict()["trunk"] == "int8" and ModelOptions.from_dict(opts.to_dict()) == opts
    assert ModelOptions.from_dict({"kernels": "reference"}).build.trunk == "dense"  # manifests before the trunk
    with pytest.raises(ConfigError, match="trunk='fp16'"):
        BuildOptions(trunk="fp16")
    with pytest.raises(ConfigError, match="trunk='bf16': the activations of a bf16 trunk are fp32"):
        build_model(preset("k3-mini"), BuildOptions(trunk="bf16"), dtype=torch.bfloat16, seed=None, device="meta")
    with pytest.raises(ValueError, match="trunk='int4'"):
        convert_trunk(build_model(preset("k3-mini"), device="meta", seed=None), "int4")
