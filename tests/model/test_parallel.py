"""The parallel plan (model/parallel.py), rank modules (model/rank.py) and sharded loading
(checkpoint/rank_slices.py), all in one process: no collectives run here (tests/runtime/test_ranks_dist.py does)."""

from __future__ import annotations


import pytest
import torch

from k3x.checkpoint.save import save_checkpoint
from k3x.checkpoint.rank_slices import load_rank
from k3x.model import build_model, preset, state_specs
from k3x.model.parallel import ParallelError, ParallelPlan, merge_states, split_of, split_states
from k3x.model.rank import build_rank_model, rank_state_dict


def mini4():
    """k3-mini: 4 KDA and 4 MLA heads, 8 experts (splits at TP=2 x EP=2)."""
    return preset("k3-mini")


def test_every_parameter_has_a_split_and_the_expected_kind():
    table = ParallelPlan(2, 2).table(preset("k3"))
    kinds = {k: s.kind for k, s in table.items()}
    assert kinds["model.embed_tokens.weight"] == kinds["lm_head.weight"] == "vocab"
    assert kinds["model.layers.0.self_attn.q_proj.weight"] == "column"  # KDA
    assert kinds["model.layers.0.self_attn.A_log"] == kinds["model.layers.0.self_attn.dt_bias"] == "column"
    assert kinds["model.layers.0.self_attn.f_a_proj.weight"] == "replicated"
    assert kinds["model.layers.3.self_attn.q_b_proj.weight"] == kinds["model.layers.3.self_attn.kv_b_proj.weight"] \
        == "column"  # MLA
    assert kinds["model.layers.3.self_attn.kv_a_proj_with_mqa.weight"] == "replicated"
    assert kinds["model.layers.3.self_attn.o_proj.weight"] == kinds["model.layers.0.mlp.down_proj.weight"] == "row"
    assert kinds["model.layers.1.block_sparse_moe.experts.w1"] == "expert"
    assert kinds["model.layers.1.block_sparse_moe.gate.weight"] == "replicated"
    assert kinds["model.layers.1.block_sparse_moe.gate.e_score_correction_bias"] == "replicated"
    assert kinds["model.layers.1.block_sparse_moe.routed_expert_down_proj.weight"] == "replicated"
    assert kinds["model.layers.1.block_sparse_moe.shared_experts.down_proj.weight"] == "row"
    assert set(kinds.values()) == {"column", "row", "expert", "vocab", "replicated"}
    assert split_of("model.layers.1.block_sparse_moe.experts.w2").dim == 0  # the expert axis: packed or not


@pytest.mark.parametrize("tp,ep,field", [(3, 1, "kda.num_heads=4"), (1, 3, "moe.num_experts=8"),
                                         (8, 1, "kda.num_heads=4")])
def test_plan_checked_against_the_config_naming_the_field(tp, ep, field):
    with pytest.raises(ParallelError, match=f"^{field}: not divisible by"):
        ParallelPlan(tp, ep).check(preset("k3-mini"))


def test_plan_sizes_checked():
    with pytest.raises(ParallelError, match="^tp=0"):
        ParallelPlan(0, 1)
    with pytest.raises(ParallelError, match="^ep=True"):
        ParallelPlan(1, True)
    ParallelPlan(8, 16).check(preset("k3"))  # the K3 serving layout divides


def test_rank_layout_and_groups():
    p = ParallelPlan(2, 2)
    assert [(p.tp_rank(r), p.ep_rank(r)) for r in range(4)] == [(0, 0), (1, 0), (0, 1), (1, 1)]
    assert p.tp_group_ranks(3) == [2, 3] and p.ep_group_ranks(3) == [1, 3]
    assert list(p.expert_range(preset("k3-mini"), 3)) == [4, 5, 6, 7]


def test_states_split_and_merge_back_exactly():
    cfg, plan = mini4(), ParallelPlan(2, 1)
    full = [torch.randn(s.shape(2, 5)) for s in state_specs(cfg)]
    parts = [split_states(cfg, plan, full, t) for t in range(2)]
    local = plan.local_config(cfg)
    assert [tuple(x.shape) for x in parts[1]] == [s.shape(2, 5) for s in state_specs(local)]
    conv = parts[1][0]  # rank 1 holds heads 2..3 of each of q, k, v
    P = cfg.kda.proj_dim
    assert torch.equal(conv[:, :P // 2], full[0][:, P // 2:P]) and torch.equal(conv[:, P:], full[0][:, 2 * P + P // 2:])
    assert all(torch.equal(a, b) for a, b in zip(merge_states(cfg, plan, parts), full))


def test_rank_program_is_the_local_model_plus_collectives():
    cfg, plan = mini4(), ParallelPlan(2, 2)
    m = build_rank_model(cfg, plan)
    sd = m.state_dict()
    assert sd["model.layers.0.self_attn.q_proj.weight"].shape == (32, 64)  # 2 of 4 heads x 16
    assert sd["model.layers.0.self_attn.o_proj.weight"].shape == (64, 32)
    assert sd["model.layers.1.block_sparse_moe.experts.w1"].shape == (4, 32, 32)  # 4 of 8 experts
    assert sd["model.layers.1.block_sparse_moe.gate.weight"].shape == (8, 64)  # router: all experts
    assert sd["model.embed_tokens.weight"].shape == sd["lm_head.weight"].shape == (256, 64)
    assert {"model.embed_tokens.vocab_start", "model.layers.1.block_sparse_moe.expert_offset"} <= set(sd)
    assert m.cfg.kda.num_heads == 2 and m.cfg.vocab_size == 256


def test_sharded_loading_reads_each_ranks_slice_from_the_checkpoint(tmp_path):
    cfg, plan = mini4(), ParallelPlan(2, 2)
    full = build_model(cfg, seed=0)
    save_checkpoint(full, tmp_path / "ck", expert_format="dense")
    sd = full.state_dict()
    for rank in (1, 2):
        got_cfg, model = load_rank(tmp_path / "ck", plan, rank)
        want = rank_state_dict(sd, cfg, plan, rank)
        got = model.state_dict()
        assert got_cfg == cfg and set(got) == set(want)
        bad = [k for k in want if not torch.equal(got[k], want[k])]
        assert not bad, bad[:5]
    e = model.model.layers[1].block_sparse_moe
    assert e.expert_offset.tolist() == [4] and model.model.embed_tokens.vocab_start.item() == 0
    assert torch.equal(e.experts.w1, sd["model.layers.1.block_sparse_moe.experts.w1"][4:])


def test_sharded_loading_opens_only_the_ranks_experts(tmp_path, monkeypatch):
    from k3x.checkpoint import rank_slices as shard_load

    cfg, plan = mini4(), ParallelPlan(1, 2)
    save_checkpoint(build_model(cfg, seed=0), tmp_path / "ck", expert_format="mxfp4")
    read: list[str] = []
    real = shard_load.Shards.__missing__

    class Spy:
        def __init__(self, h):
            self.h = h

        def get_tensor(self, name):
            read.append(name)
            return self.h.get_tensor(name)

        def __getattr__(self, item):
            return getattr(self.h, item)

    def missing(self, f):
        self[f] = h = Spy(real(self, f))
        return h

    monkeypatch.setattr(shard_load.Shards, "__missing__", missing)
    load_rank(tmp_path / "ck", plan, 1)
    experts = {int(n.split(".experts.")[1].split(".")[0]) for n in read if ".experts." in n}
    assert experts == {4, 5, 6, 7}


def test_packed_checkpoint_stays_packed_in_each_rank(tmp_path):
    """MXFP4 experts are read as stored into the rank's packed experts (its slice of the expert axis, bytes
    and scales unchanged); expert_format="dense" decodes them as the single-GPU loader does."""
    from k3x.checkpoint.files import load_checkpoint

    cfg, plan = mini4(), ParallelPlan(1, 2)
    save_checkpoint(build_model(cfg, seed=0), tmp_path / "ck", expert_format="mxfp4")
    whole = load_checkpoint(tmp_path / "ck").state_dict()  # packed
    got_cfg, model = load_rank(tmp_path / "ck", plan, 1)
    sd = model.state_dict()
    assert got_cfg == cfg and model.build.expert_format == "mxfp4"
    for name in ("experts.w1", "experts.w2_scale"):
        key = f"model.layers.1.block_sparse_moe.{name}"
        assert sd[key].dtype == torch.uint8 and torch.equal(sd[key], whole[key][4:])
    dense = load_rank(tmp_path / "ck", plan, 1, expert_format="dense")[1].state_dict()
    assert dense["model.layers.1.block_sparse_moe.experts.w1"].dtype == torch.float32


def test_budget_per_rank_bytes_collectives_and_fit():
    from k3x.model.parallel_budget import budget, rank_weight_bytes
    from k3x.model.summary import summarize

    cfg = preset("k3")
    whole = summarize(cfg)["bytes_by_storage_format"]
    one = rank_weight_bytes(cfg, ParallelPlan(1, 1))
    assert one == whole  # the trivial plan is the checkpoint's own storage
    b = budget(cfg, ParallelPlan(8, 16), batch=8, context=131072)
    w = b["weight_bytes_per_rank"]
    assert w["mxfp4_experts"] == whole["mxfp4_experts"] // 16  # experts split 16 ways
    assert whole["bf16"] // 8 < w["bf16"] < whole["bf16"] // 2  # heads/FFN/vocab split 8 ways, the rest replicated
    assert b["experts_per_rank"] == 56 and b["heads_per_rank"] == 12
    assert b["mla_cache_bytes_per_token"] == 24 * 576 * 2  # 24 MLA layers x (512 + 64) bf16, on every TP rank
    comm = b["collective_bytes_per_token_per_layer"]
    assert comm["mixer_tp_all_reduce"]["payload"] == 7168 * 2 and comm["routed_ep_all_reduce"]["payload"] == 3584 * 2
    assert comm["routed_ep_all_reduce"]["ring_send"] == 2 * 15 * 3584 * 2 // 16
    fit = b["fit"]
    assert not fit["H200"]["fits"] and fit["B200"]["fits"] and fit["GB300"]["fits"]
    with pytest.raises(ParallelError, match="^moe.num_experts=896: not divisible by ep=3"):
        budget(cfg, ParallelPlan(8, 3), batch=1, context=1)


def test_inspect_cli_with_a_plan():
    import json

    from typer.testing import CliRunner

    from k3x.cli import app

    r = CliRunner().invoke(app, ["inspect", "--preset", "k3", "--tp", "8", "--ep", "16", "--batch", "4", "--json"])
    assert r.exit_code == 0, r.output
    b = json.loads(r.output)
    assert (b["world"], b["batch"], b["context"]) == (128, 4, 131072) and set(b["fit"]) == {"H200", "B200", "GB300"}
    r = CliRunner().invoke(app, ["inspect", "--preset", "k3-mini", "--tp", "3"])
    assert r.exit_code == 1 and "kda.num_heads=4: not divisible by tp=3" in r.output
    r = CliRunner().invoke(app, ["inspect", "--preset", "k3-mini", "--tp", "2", "--ep", "2"])
    assert r.exit_code == 0, r.output  # the default tiny model splits as the README's multi-GPU lines do
