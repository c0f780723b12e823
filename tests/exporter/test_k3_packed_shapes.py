"""The real K3 with MXFP4 experts, weightless: the traced program carries the packed shapes (compressed-tensors
`weight_packed [3072, 1792]` / `weight_scale [3072, 112]` per expert, stacked), and `k3x inspect` reports each
artifact's weight bytes at the checkpoint's size (within 5%)."""

from __future__ import annotations

import dataclasses

import torch

from k3x.model import build_model, preset
from k3x.model.options import BuildOptions
from k3x.model.summary import summarize


def k3_layers(n: int):
    cfg = preset("k3")
    return dataclasses.replace(cfg, layer_types=cfg.layer_types[:n], mlp_types=cfg.mlp_types[:n])


def test_weightless_k3_trace_carries_packed_expert_shapes():
    from k3x.exporter.trace import op_counts, trace

    packed = BuildOptions(expert_format="mxfp4")
    ep = trace(build_model(k3_layers(2), packed, device="meta", dtype=torch.bfloat16, seed=None))
    sd = ep.state_dict
    e = "model.layers.1.block_sparse_moe.experts"
    shapes = {k: (list(sd[f"{e}.{k}"].shape), sd[f"{e}.{k}"].dtype)
              for k in ("w1", "w1_scale", "w3", "w2", "w2_scale")}
    assert shapes == {"w1": ([896, 3072, 1792], torch.uint8), "w1_scale": ([896, 3072, 112], torch.uint8),
                      "w3": ([896, 3072, 1792], torch.uint8), "w2": ([896, 3584, 1536], torch.uint8),
                      "w2_scale": ([896, 3584, 96], torch.uint8)}
    assert op_counts(ep).get("k3::moe_mxfp4") == 1 and not op_counts(ep).get("k3::moe")


def test_inspect_reports_artifact_bytes_at_the_checkpoint_size():
    s = summarize(k3_layers(4))
    packed, dense = s["artifact_weight_bytes"]["mxfp4"], s["artifact_weight_bytes"]["dense"]
    ckpt = s["checkpoint_bytes"]
    assert abs(packed - ckpt) <= 0.05 * ckpt, (packed, ckpt)
    assert dense > 3 * packed  # bf16 experts: 16 bits against 4.25
