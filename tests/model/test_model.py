"""The model: prefill + decode == one forward; Kimi-Linear variant; docs/model.md §11 names and shapes."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from k3x.model import build_model, empty_state, preset
from k3x.model.config import MoEConfig
from tolerances import assert_close


def kimi_linear_mini():
    """k3-mini with the Kimi Linear branches: no AttnRes, low-rank output gate, unbounded gate, SwiGLU, plain MoE."""
    c = preset("k3-mini")
    return dataclasses.replace(
        c, name="kimi-linear-mini", attn_res=None, activation="silu",
        kda=dataclasses.replace(c.kda, gate_lower_bound=None, full_rank_output_gate=False),
        mla=dataclasses.replace(c.mla, q_lora_rank=None, output_gate=False),
        moe=MoEConfig(num_experts=8, top_k=2, intermediate_size=32, num_shared_experts=1, latent_dim=None,
                      latent_norm=False, routed_scaling_factor=2.446))


@pytest.mark.parametrize("cfg", [preset("k3-mini"), kimi_linear_mini()], ids=lambda c: c.name)
@pytest.mark.parametrize("T,split", [(12, 1), (68, 61), (68, 67)], ids=["decode-all", "prefill-61", "prefill-67"])
def test_prefill_then_decode_equals_full_forward(cfg, T, split):
    model = build_model(cfg, seed=1)
    B = 2  # T = 68 crosses a 64-token KDA chunk
    ids = torch.randint(0, cfg.vocab_size, (B, T))
    with torch.no_grad():
        full, _ = model(ids, empty_state(cfg, B))
        logits, state = model(ids[:, :split], empty_state(cfg, B))
        steps = [logits]
        for t in range(split, T):
            logits, state = model(ids[:, t:t + 1], state)
            steps.append(logits)
    assert full.shape == (B, T, cfg.vocab_size) and full.dtype == torch.float32
    assert_close(torch.cat(steps, 1), full, torch.float32, f"split at {split}")
    assert full.std() > 0.1  # O(1) logits, not a degenerate model


def test_batch_rows_are_independent():
    cfg = preset("k3-mini")
    model = build_model(cfg, seed=2)
    ids = torch.randint(0, cfg.vocab_size, (3, 9))
    with torch.no_grad():
        batched, _ = model(ids, empty_state(cfg, 3))
        single, _ = model(ids[1:2], empty_state(cfg, 1))
    assert_close(batched[1:2], single, torch.float32, "row 1")


def test_state_shapes_names_and_precision_plan():
    """bf16 model: KDA conv/recurrent states stay fp32, the MLA latent cache is bf16, logits fp32."""
    cfg = preset("k3-mini")
    model = build_model(cfg, dtype=torch.bfloat16)
    with torch.no_grad():
        logits, state = model(torch.zeros(2, 5, dtype=torch.long), empty_state(cfg, 2, torch.bfloat16))
    P, H, D = cfg.kda.proj_dim, cfg.kda.num_heads, cfg.kda.head_dim
    assert [tuple(s.shape) for s in state[:2]] == [(2, 3 * P, 3), (2, H, D, D)]
    assert tuple(state[4].shape) == (2, 5, cfg.mla.latent_dim)  # layer 2 is MLA
    assert [s.dtype for s in state[:5]] == [torch.float32] * 4 + [torch.bfloat16]
    assert logits.dtype == torch.float32 and torch.isfinite(logits).all()


def test_k3_parameter_names_and_shapes_match_spec():
    sd = build_model(preset("k3"), device="meta", seed=None).state_dict()
    spec = {  # docs/model.md §11
        "model.embed_tokens.weight": (163840, 7168), "lm_head.weight": (163840, 7168),
        "model.norm.weight": (7168,), "model.output_attn_res_proj.weight": (1, 7168),
        "model.layers.0.self_attn.q_proj.weight": (12288, 7168),
        "model.layers.0.self_attn.q_conv1d.weight": (12288, 1, 4),
        "model.layers.0.self_attn.f_a_proj.weight": (128, 7168), "model.layers.0.self_attn.f_b_proj.weight": (12288, 128),
        "model.layers.0.self_attn.b_proj.weight": (96, 7168), "model.layers.0.self_attn.A_log": (96,),
        "model.layers.0.self_attn.dt_bias": (12288,), "model.layers.0.self_attn.g_proj.weight": (12288, 7168),
        "model.layers.0.self_attn.o_norm.weight": (128,), "model.layers.0.self_attn.o_proj.weight": (7168, 12288),
        "model.layers.0.mlp.gate_proj.weight": (33792, 7168),
        "model.layers.0.self_attention_res_proj.weight": (1, 7168), "model.layers.0.mlp_res_norm.weight": (7168,),
        "model.layers.3.self_attn.q_a_proj.weight": (1536, 7168), "model.layers.3.self_attn.q_b_proj.weight": (18432, 1536),
        "model.layers.3.self_attn.kv_a_proj_with_mqa.weight": (576, 7168),
        "model.layers.3.self_attn.kv_a_layernorm.weight": (512,),
        "model.layers.3.self_attn.kv_b_proj.weight": (24576, 512),
        "model.layers.3.self_attn.g_proj.weight": (12288, 7168), "model.layers.3.self_attn.o_proj.weight": (7168, 12288),
        "model.layers.1.block_sparse_moe.gate.weight": (896, 7168),
        "model.layers.1.block_sparse_moe.gate.e_score_correction_bias": (896,),
        "model.layers.1.block_sparse_moe.routed_expert_down_proj.weight": (3584, 7168),
        "model.layers.1.block_sparse_moe.routed_expert_norm.weight": (3584,),
        "model.layers.1.block_sparse_moe.routed_expert_up_proj.weight": (7168, 3584),
        "model.layers.1.block_sparse_moe.experts.w1": (896, 3072, 3584),
        "model.layers.1.block_sparse_moe.experts.w3": (896, 3072, 3584),
        "model.layers.1.block_sparse_moe.experts.w2": (896, 3584, 3072),
        "model.layers.1.block_sparse_moe.shared_experts.gate_proj.weight": (6144, 7168),
        "model.layers.92.self_attn.kv_b_proj.weight": (24576, 512),
    }
    for name, shape in spec.items():
        assert tuple(sd[name].shape) == shape, name
    assert not any(".ffn." in k for k in sd)  # no aliased duplicates


def test_custom_ops_are_the_only_path(monkeypatch):
    """Breaking torch.ops.k3.* must break the model: it has no private copy of KDA/AttnRes/MoE."""
    cfg = preset("k3-mini")
    model = build_model(cfg)
    calls = []
    real = torch.ops.k3.kda

    class Spy:
        def __call__(self, *a):
            calls.append(1)
            return real(*a)

    monkeypatch.setattr(torch.ops.k3, "kda", Spy())
    with torch.no_grad():
        model(torch.zeros(1, 4, dtype=torch.long), empty_state(cfg, 1))
    assert len(calls) == len(cfg.kda_layers)


def test_top1_routing_keeps_the_raw_score():
    """Renormalising a single selected score would make every weight 1; Kimi's router does not."""
    c = preset("k3-mini")
    cfg = dataclasses.replace(c, moe=dataclasses.replace(c.moe, top_k=1))
    layer = build_model(cfg).model.layers[1].block_sparse_moe
    assert layer.options.renormalize is False
    assert build_model(c).model.layers[1].block_sparse_moe.options.renormalize is True
    x = torch.randn(5, cfg.hidden_size)
    z = layer.routed_expert_down_proj(x)
    e = layer.experts
    u = torch.ops.k3.moe(x, z, layer.gate.weight, layer.gate.e_score_correction_bias, e.w1, e.w3, e.w2,
                         *layer.options.args(), "reference")
    s = torch.sigmoid(x @ layer.gate.weight.t())
    j = torch.argmax(s + layer.gate.e_score_correction_bias, -1)
    from k3x.custom_ops.moe.reference import glu
    expect = torch.stack([s[n, j[n]] * (e.w2[j[n]] @ glu(e.w1[j[n]] @ z[n], e.w3[j[n]] @ z[n], "situ", 4.0, 25.0))
                          for n in range(5)])
    assert_close(u, expect, torch.float32, "top-1 MoE")
