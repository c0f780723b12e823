"""exporter/trace.py: one torch.export program per config, custom ops as single nodes, `.pt2` round trips.

- k3-mini (real weights), kimi-linear-48b and the full 93-layer k3 (meta device; stamped, as its export traces
  it) have exact k3 op counts, no MLA custom op, and (k3) the parameter shapes of docs/model.md §11.
- A `.pt2` loads in a fresh process that only imports k3x and matches eager for a prefill (past_seq = 0)
  and a decode step (seq = 1) through the one program. (Weightless `.pt2` + `with_weights`:
  test_export_cli.py.)
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

from k3x.exporter.stamp import trace_recorded
from k3x.exporter.trace import op_counts, save_pt2, trace
from k3x.folder.dims import DYNAMIC_DIMS
from k3x.model import build_model, empty_state, preset
from k3x.model.state import state_specs
from tolerances import assert_close

ALLOWED_K3_OPS = {"k3::kda", "k3::attn_res", "k3::moe"}


def k3_targets(ep) -> set[str]:
    """Every non-aten operator namespace::name called in the graph."""
    out = set()
    for n in ep.graph.nodes:
        if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload) and n.target.namespace != "aten":
            out.add(n.target.name().split(".")[0])
    return out


@pytest.fixture(scope="module")
def mini_ep():
    model = build_model(preset("k3-mini"), seed=0)
    return model, trace(model)


@pytest.fixture(scope="module")
def k3_ep():
    """The full K3 on meta as `k3x export --preset k3` traces it: stamped (exporter/stamp.py), ~13 s where the
    per-layer trace of its 93 layers took ~115 s of CI (that tracer's own cases: the smaller configs here and
    tests/exporter/test_stamp.py, which compares the two)."""
    ep, recorded = trace_recorded(build_model(preset("k3"), device="meta", dtype=torch.bfloat16, seed=None))
    assert recorded == {"mode": "stamped", "fallback": None}
    return ep


def test_k3_mini_op_counts(mini_ep):
    _, ep = mini_ep
    assert op_counts(ep) == {"k3::attn_res": 12, "k3::kda": 3, "k3::moe": 5}
    assert k3_targets(ep) == ALLOWED_K3_OPS
    from k3x.exporter.ranks import collective_counts

    assert collective_counts(ep) == {}  # the single-GPU program has no collectives (rank programs: test_ranks_dist)


def test_kimi_linear_48b_on_meta_op_counts():
    ep = trace(build_model(preset("kimi-linear-48b"), device="meta", dtype=torch.bfloat16, seed=None))
    assert op_counts(ep) == {"k3::kda": 20, "k3::moe": 26}  # no AttnRes in Kimi Linear
    assert not any("mla" in t for t in k3_targets(ep))


def test_k3_on_meta_op_counts(k3_ep):
    # 69 KDA layers; MoE in layers 1..92; AttnRes: 92 attention-input mixes (layers 1..92),
    # 93 FFN-input mixes and the output mix
    assert op_counts(k3_ep) == {"k3::attn_res": 92 + 93 + 1, "k3::kda": 69, "k3::moe": 92}
    assert k3_targets(k3_ep) == ALLOWED_K3_OPS  # MLA is plain PyTorch: no mla custom op
    assert {t.device.type for t in k3_ep.state_dict.values()} == {"meta"}


# docs/model.md §11, `[out, in]`
K3_SHAPES = {
    "model.embed_tokens.weight": [163840, 7168], "lm_head.weight": [163840, 7168], "model.norm.weight": [7168],
    "model.output_attn_res_norm.weight": [7168], "model.output_attn_res_proj.weight": [1, 7168],
    # layer 0: KDA + dense FFN
    **{f"model.layers.0.self_attn.{p}_proj.weight": [12288, 7168] for p in "qkv"},
    **{f"model.layers.0.self_attn.{p}_conv1d.weight": [12288, 1, 4] for p in "qkv"},
    "model.layers.0.self_attn.f_a_proj.weight": [128, 7168], "model.layers.0.self_attn.f_b_proj.weight": [12288, 128],
    "model.layers.0.self_attn.b_proj.weight": [96, 7168], "model.layers.0.self_attn.A_log": [96],
    "model.layers.0.self_attn.dt_bias": [12288], "model.layers.0.self_attn.g_proj.weight": [12288, 7168],
    "model.layers.0.self_attn.o_norm.weight": [128], "model.layers.0.self_attn.o_proj.weight": [7168, 12288],
    "model.layers.0.mlp.gate_proj.weight": [33792, 7168], "model.layers.0.mlp.up_proj.weight": [33792, 7168],
    "model.layers.0.mlp.down_proj.weight": [7168, 33792],
    "model.layers.0.input_layernorm.weight": [7168], "model.layers.0.post_attention_layernorm.weight": [7168],
    "model.layers.0.self_attention_res_norm.weight": [7168], "model.layers.0.self_attention_res_proj.weight": [1, 7168],
    "model.layers.0.mlp_res_norm.weight": [7168], "model.layers.0.mlp_res_proj.weight": [1, 7168],
    # layer 3 (and 92): MLA
    "model.layers.3.self_attn.q_a_proj.weight": [1536, 7168], "model.layers.3.self_attn.q_a_layernorm.weight": [1536],
    "model.layers.3.self_attn.q_b_proj.weight": [18432, 1536],
    "model.layers.3.self_attn.kv_a_proj_with_mqa.weight": [576, 7168],
    "model.layers.3.self_attn.kv_a_layernorm.weight": [512], "model.layers.3.self_attn.kv_b_proj.weight": [24576, 512],
    "model.layers.3.self_attn.g_proj.weight": [12288, 7168], "model.layers.3.self_attn.o_proj.weight": [7168, 12288],
    "model.layers.92.self_attn.kv_b_proj.weight": [24576, 512],
    # layer 1 (and 92): LatentMoE, experts stacked [E, out, in]
    "model.layers.1.block_sparse_moe.gate.weight": [896, 7168],
    "model.layers.1.block_sparse_moe.gate.e_score_correction_bias": [896],
    "model.layers.1.block_sparse_moe.routed_expert_down_proj.weight": [3584, 7168],
    "model.layers.1.block_sparse_moe.routed_expert_norm.weight": [3584],
    "model.layers.1.block_sparse_moe.routed_expert_up_proj.weight": [7168, 3584],
    "model.layers.1.block_sparse_moe.experts.w1": [896, 3072, 3584],
    "model.layers.1.block_sparse_moe.experts.w3": [896, 3072, 3584],
    "model.layers.1.block_sparse_moe.experts.w2": [896, 3584, 3072],
    "model.layers.1.block_sparse_moe.shared_experts.gate_proj.weight": [6144, 7168],
    "model.layers.1.block_sparse_moe.shared_experts.up_proj.weight": [6144, 7168],
    "model.layers.1.block_sparse_moe.shared_experts.down_proj.weight": [7168, 6144],
    "model.layers.92.block_sparse_moe.experts.w2": [896, 3584, 3072],
}


def test_k3_traced_parameter_shapes_match_spec(k3_ep):
    sd = k3_ep.state_dict
    got = {name: list(sd[name].shape) for name in K3_SHAPES if name in sd}
    assert sorted(set(K3_SHAPES) - set(got)) == []
    assert got == K3_SHAPES
    assert not any(n.startswith("model.layers.93.") for n in sd)
    assert sum(t.numel() for t in sd.values()) > 2.7e12  # 2.78 T parameters, none allocated


def test_dynamic_dims_are_declared_once(mini_ep):
    """input_ids [batch, seq] and the MLA latent [batch, past_seq, .] carry DYNAMIC_DIMS' ranges."""
    model, ep = mini_ep
    user = [n for n in ep.graph.nodes if n.op == "placeholder" and n.name in ep.graph_signature.user_inputs]
    latent = 1 + [s.kind for s in state_specs(model.cfg)].index("latent")

    def bounds(node, dim):
        r = ep.range_constraints[node.meta["val"].shape[dim].node.expr]
        return int(r.lower), int(r.upper)

    want = {n: (d.min, d.max) for n, d in DYNAMIC_DIMS.items()}
    assert bounds(user[0], 0) == want["batch"] and bounds(user[0], 1) == want["seq"]
    assert bounds(user[latent], 0) == want["batch"] and bounds(user[latent], 1) == want["past_seq"]
    assert user[latent].meta["val"].shape[0].node.expr == user[0].meta["val"].shape[0].node.expr  # one batch


FRESH = textwrap.dedent("""
    import sys, torch
    assert "k3x" not in sys.modules and not hasattr(torch.ops.k3, "kda")
    from k3x.exporter.trace import load_pt2  # importing k3x registers the ops
    path, io = sys.argv[1:]
    feeds = torch.load(io)
    module = load_pt2(path).module()
    logits, present = module(feeds["prefill_ids"], feeds["past"])
    logits2, present2 = module(feeds["decode_ids"], present)
    torch.save((logits, present, logits2, present2), io)
""")


def test_pt2_roundtrip_in_fresh_process(mini_ep, tmp_path):
    model, ep = mini_ep
    cfg = model.cfg
    save_pt2(ep, tmp_path / "model.pt2")
    prefill_ids = torch.randint(0, cfg.vocab_size, (2, 5))
    decode_ids = torch.randint(0, cfg.vocab_size, (2, 1))
    past = empty_state(cfg, 2)  # past_seq = 0
    torch.save({"prefill_ids": prefill_ids, "decode_ids": decode_ids, "past": past}, tmp_path / "io.pt")
    proc = subprocess.run([sys.executable, "-c", FRESH, str(tmp_path / "model.pt2"), str(tmp_path / "io.pt")],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    g_logits, g_present, g_logits2, g_present2 = torch.load(tmp_path / "io.pt")
    check_prefill_decode(model, prefill_ids, decode_ids, past, g_logits, g_present, g_logits2, g_present2)


def check_prefill_decode(model, prefill_ids, decode_ids, past, logits, present, logits2, present2, what="pt2"):
    """Compare a program's prefill + decode outputs with eager's."""
    with torch.no_grad():
        e_logits, e_present = model(prefill_ids, past)
        e_logits2, e_present2 = model(decode_ids, e_present)
    assert_close(logits, e_logits, what=f"{what} prefill logits")
    assert_close(logits2, e_logits2, what=f"{what} decode logits")
    assert len(present) == len(present2) == len(e_present2)
    for i, (a, b) in enumerate(zip(present2, e_present2)):
        assert_close(a, b, what=f"{what} decode present[{i}]")
    latent = [s.kind for s in state_specs(model.cfg)].index("latent")
    assert present2[latent].shape[1] == prefill_ids.shape[1] + 1  # MLA cache grew 0 -> T -> T+1, one program


def test_with_weights_names_what_is_wrong(mini_ep):
    from k3x.exporter.trace import with_weights

    model, ep = mini_ep
    sd = dict(model.state_dict())
    name = "model.layers.0.self_attn.q_proj.weight"
    with pytest.raises(ValueError, match=name.replace(".", r"\.")):
        with_weights(ep, {**sd, name: torch.zeros(1, 1)})
    del sd[name]
    with pytest.raises(KeyError, match="missing"):
        with_weights(ep, sd)
