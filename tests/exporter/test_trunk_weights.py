"""A trunk export's weights streamed from the checkpoint (exporter/trunk_weights.py): a bf16 checkpoint's trunk
projections are copied as stored (byte ranges, never converted), an fp32 one's rounded once; the int8 trunk's
codes and scales are the quantiser's of the checkpoint's weights; every entry is the trunk model's state_dict
entry, in its order, shape and dtype."""

from __future__ import annotations

import pytest
import torch
from trunk_models import decisive_checkpoint

from k3x.checkpoint.byte_ranges import StoredTensor
from k3x.checkpoint.files import load_checkpoint
from k3x.custom_ops.linear_q8.reference import quantize
from k3x.exporter.trunk_weights import stored_values, trunk_stream
from k3x.model import build_model, preset
from k3x.model.options import BuildOptions
from k3x.model.trunk import trunk_weight_names


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("trunk-weights")
    return {"fp32": decisive_checkpoint(root / "fp32"), "bf16": decisive_checkpoint(root / "bf16", torch.bfloat16)}


@pytest.mark.parametrize("stored", ["fp32", "bf16"])
@pytest.mark.parametrize("trunk", ["bf16", "int8"])
def test_the_stream_is_the_trunk_models_state_dict(checkpoints, stored, trunk):
    cfg = preset("k3-mini")
    build = BuildOptions(expert_format="mxfp4", trunk=trunk)
    want = build_model(cfg, build, device="meta", seed=None).state_dict()
    source = load_checkpoint(checkpoints[stored], dtype=torch.float32, expert_format="mxfp4").state_dict()
    names = trunk_weight_names(build_model(cfg, BuildOptions(expert_format="mxfp4"), device="meta", seed=None))
    got = list(trunk_stream(checkpoints[stored], cfg, torch.float32, build))
    assert [n for n, _ in got] == list(want)
    for name, t in got:
        assert (t.dtype, tuple(t.shape)) == (want[name].dtype, tuple(want[name].shape)), name
        module = name.rsplit(".", 1)[0]
        if trunk == "bf16" and name in names:
            # a bf16 checkpoint's bytes copied as stored; an fp32 one's rounded once
            assert isinstance(t, StoredTensor) == (stored == "bf16"), name
            assert torch.equal(stored_values(t), source[name].to(torch.bfloat16))
        elif trunk == "int8" and name.endswith((".qweight", ".scales")):
            q, s = quantize(source[f"{module}.weight"])
            assert torch.equal(t, q if name.endswith(".qweight") else s), name
