"""The `ort` body of k3::MoE (custom_ops/moe/onnx.py `function`): sparse (a Loop over the hit experts
only, or a batch: per expert up to UNROLL_MAX local experts, padded above) and exact against
custom_ops/moe/reference.py under the tolerance table, for random routing, decode and prefill through one
session (dynamic N), an expert hit by every token, top_k = E, top_k = 1, and bf16 expert weights stored as
initializers (as in an exported model).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import onnx
import onnx_ir as ir
import pytest
import torch
from onnx import helper

from k3x.custom_ops.moe.onnx import function as moe_function
from k3x.custom_ops.moe.onnx import per_expert_count
from k3x.custom_ops.moe.onnx_experts import UNROLL_MAX
from k3x.custom_ops.moe.reference import moe
from k3x.plan import onnx_node
from moe_models import moe_model, tokens, weights
from tolerances import assert_close

ort = pytest.importorskip("onnxruntime")


class MoESession:
    """One k3::MoE node over the `ort` pass: x [N, d], z [N, L] fp32 inputs (N dynamic), weights as initializers."""

    def __init__(self, w: dict[str, torch.Tensor], top_k: int, activation: str = "situ", renormalize: bool = True,
                 factor: float = 1.0, offset: int | None = None, profile: str | None = None,
                 optimized: str | None = None):
        self.w, self.args = w, (top_k, factor, renormalize, activation, 4.0, 25.0)
        self.offset = None if offset is None else torch.tensor([offset], dtype=torch.int32)
        proto = moe_model(w, top_k, activation, renormalize, factor, offset)
        so = ort.SessionOptions()
        if profile is not None:
            so.enable_profiling, so.profile_file_prefix = True, profile
        if optimized is not None:  # the graph as ONNX Runtime runs it, after its constant folding
            so.optimized_model_filepath = optimized
        self.sess = ort.InferenceSession(proto.SerializeToString(), so, providers=["CPUExecutionProvider"])

    def nodes_run(self) -> list[dict]:
        """The node events of a profiled session (ends its profile)."""
        return [e for e in json.loads(Path(self.sess.end_profiling()).read_text()) if e.get("cat") == "Node"]

    def steps_run(self) -> set[str]:
        """The body steps whose nodes ran (profiled sessions): `per_expert` or `padded` (the If's batch) or
        `expert` (the Loop body)."""
        return body_steps(self.nodes_run())

    def check(self, x: torch.Tensor, z: torch.Tensor, what: str) -> torch.Tensor:
        (u,) = self.sess.run(None, {"x": x.numpy(), "z": z.numpy()})
        assert_close(torch.from_numpy(u), moe(x, z, *self.w.values(), *self.args, self.offset), torch.float32, what)
        return torch.from_numpy(u)


def body_steps(events: list[dict]) -> set[str]:
    return {m.group(1) for e in events for m in [re.search(r"_inlfunc_MoE_MoE/(\w+)/", e["name"])] if m}


@pytest.mark.parametrize("activation,renormalize,factor", [
    pytest.param("situ", True, 1.0, id="situ-renorm"),
    pytest.param("silu", False, 2.446, id="silu-scaled"),
])
def test_random_routing_decode_and_prefill_one_session(activation, renormalize, factor):
    E, k, d, L, I = 16, 4, 24, 16, 12
    s = MoESession(weights(E, d, L, I), k, activation, renormalize, factor)
    for N in (1, 2, 5, 64):  # decode (M = k < E), M = E / 2 .. M >> E (every expert hit several times)
        s.check(*tokens(N, d, L, seed=N), f"N={N}")


def test_expert_hit_by_every_token_weighs_unbiased():
    E, k, d, L, I = 8, 3, 24, 16, 12
    w = weights(E, d, L, I)
    w["gate_bias"][5] = 10.0  # selects expert 5 for every token; must not enter its weight
    s = MoESession(w, k)
    s.check(*tokens(1, d, L, seed=1), "hot expert, N=1")
    s.check(*tokens(33, d, L, seed=2), "hot expert, N=33")


@pytest.mark.parametrize("top_k", [1, 6], ids=["top_k=1", "top_k=E"])
def test_top_k_extremes(top_k):
    E, d, L, I = 6, 24, 16, 12
    s = MoESession(weights(E, d, L, I), top_k)
    for N in (1, 17):
        s.check(*tokens(N, d, L, seed=N), f"top_k={top_k} N={N}")


def test_bf16_expert_weights():
    E, k, d, L, I = 8, 2, 24, 16, 12
    s = MoESession(weights(E, d, L, I, dtype=torch.bfloat16), k)
    for N in (1, 9):
        s.check(*tokens(N, d, L, seed=N), f"bf16 weights N={N}")


PATHS = {"per_expert", "padded", "expert"}


@pytest.mark.parametrize("E,N,top_k,path", [
    pytest.param(16, 1, 4, "per_expert", id="decode-4-of-16-hit:per-expert"),
    pytest.param(16, 2, 1, "per_expert", id="2-pairs:per-expert"),
    pytest.param(16, 48, 4, "per_expert", id="prefill-balanced:per-expert"),
    pytest.param(16, 5, 16, "per_expert", id="top_k=E:per-expert"),
    pytest.param(UNROLL_MAX, 3, 4, "per_expert", id="64-experts-most-without-pairs:per-expert"),
    pytest.param(UNROLL_MAX + 1, 100, 16, "padded", id="prefill-65-experts-top16:padded"),
    pytest.param(UNROLL_MAX + 1, 2, 4, "expert", id="decode-65-experts:loop"),
])
def test_each_expert_path_taken_by_size_and_exact(E, N, top_k, path, tmp_path):
    """fp32 experts: up to UNROLL_MAX local experts, every call runs the per-expert step (decode and prefill;
    an expert without pairs runs on zero rows); above, the If takes the padded batch over all experts when
    most are hit and few rows are padding, else the loop over hit experts. The path for the size runs (the
    others do not), and each equals the reference."""
    d, L, I = 24, 16, 12
    w = weights(E, d, L, I)
    w["gate_bias"] *= 0.2  # a small selection bias (as a trained router): balanced routing
    s = MoESession(w, top_k, profile=str(tmp_path / "ort"))
    x, z = tokens(N, d, L, seed=N)
    s.check(x, z, f"{path} E={E} N={N}")
    ran = s.steps_run()
    assert path in ran and (PATHS - {path}).isdisjoint(ran), ran


def test_per_expert_weights_fold_into_constants(tmp_path):
    """The per-expert step reads w1/w3/w2 only as Gathers at constant expert ids (w1 and w3 stacked first),
    which ONNX Runtime folds at load: in the graph it runs no node reads the stacked weights (dropped: no
    second copy of the experts in memory), and exactly two Gemms per expert ([w1; w3], then w2) take the
    folded constants."""
    E, k, d, L, I = 6, 2, 24, 16, 12
    w = weights(E, d, L, I)
    s = MoESession(w, k, optimized=str(tmp_path / "run.onnx"))
    s.check(*tokens(20, d, L, seed=4), "per-expert N=20")
    ran = onnx.load(tmp_path / "run.onnx")
    assert not {"w1", "w3", "w2"} & {i.name for i in ran.graph.initializer}
    assert not [n.op_type for n in ran.graph.node if set(n.input) & {"w1", "w3", "w2"}]
    gemms = [n for n in ran.graph.node if n.op_type == "Gemm" and "per_expert" in n.name]
    assert len(gemms) == 2 * E and all(n.input[1] in {i.name for i in ran.graph.initializer} for n in gemms)


def test_per_expert_count_is_the_shared_static_count_up_to_the_limit():
    def node(e: int | None, attr: int | None = None):
        shape = None if e is None else ir.Shape([e, 12, 16])
        inputs = [ir.Value(name=n) for n in ("x", "z", "gate_weight", "gate_bias")] + [
            ir.Value(name=n, type=ir.TensorType(ir.DataType.FLOAT), shape=shape) for n in ("w1", "w3", "w2")]
        return ir.node("MoE", inputs, {"activation": "situ", **({} if attr is None else {"num_experts": attr})},
                       domain=onnx_node.DOMAIN)

    assert per_expert_count([node(16), node(16)]) == 16
    assert per_expert_count([node(None, attr=8)]) == 8  # no static shape: the node's attribute
    assert per_expert_count([node(UNROLL_MAX)]) == UNROLL_MAX
    assert per_expert_count([node(UNROLL_MAX + 1)]) == 0  # too many copies of the step: padded
    assert per_expert_count([node(8), node(16)]) == 0  # one body serves every node: they must agree
    assert per_expert_count([node(None)]) == 0


def weight_values(dtype: ir.DataType) -> list[ir.Value]:
    return [ir.Value(name=n, type=ir.TensorType(dtype)) for n in ("w1", "w3", "w2")]


def test_padded_batch_reads_stacked_fp32_weights_in_place_and_only_for_fp32():
    """fp32 experts of unknown count: the If's batch is the padded one and reads w1/w3/w2 only as FusedMatMul
    operands (transB: no copy, no cast), its loop only through a Gather of one expert; bf16 experts get no
    batch at all (it would cast them whole)."""
    def moe_node(dtype):
        inputs = [ir.Value(name=n) for n in ("x", "z", "gate_weight", "gate_bias")] + weight_values(dtype)
        return ir.node("MoE", inputs, {"activation": "situ"}, domain=onnx_node.DOMAIN)

    fn, _ = moe_function(20, [moe_node(ir.DataType.FLOAT)])
    experts = {"w1", "w3", "w2"}
    assert not [n.op_type for n in fn.node if set(n.input) & experts]
    (branch,) = [n for n in fn.node if n.op_type == "If"]
    g = {a.name: helper.get_attribute_value(a) for a in branch.attribute}
    readers = [n for n in g["then_branch"].node if set(n.input) & experts]
    assert {(n.op_type, n.input[1], helper.get_attribute_value(n.attribute[0])) for n in readers} == {
        ("FusedMatMul", w, 1) for w in experts}  # the weights as the transposed operand, read in place
    (loop,) = [n for n in g["else_branch"].node if n.op_type == "Loop"]
    body = helper.get_attribute_value(loop.attribute[0])
    assert {n.op_type for n in body.node if set(n.input) & experts} == {"Gather"}
    fn, _ = moe_function(20, [moe_node(ir.DataType.BFLOAT16)])
    assert not [n for n in fn.node if n.op_type == "If"] and [n for n in fn.node if n.op_type == "Loop"]


def test_branches_hand_out_what_their_last_ops_write():
    """The If's branches return Y as written by their last op (the padded batch's MatMul, the loop's
    ConcatFromSequence): a Reshape as a branch output would be copied into the If's output, a pass over
    the [E·C, L] rows."""
    inputs = [ir.Value(name=n) for n in ("x", "z", "gate_weight", "gate_bias")] + weight_values(ir.DataType.FLOAT)
    fn, _ = moe_function(20, [ir.node("MoE", inputs, {"activation": "situ"}, domain=onnx_node.DOMAIN)])
    (node,) = [n for n in fn.node if n.op_type == "If"]
    for attr in node.attribute:
        made = {o: n for n in attr.g.node for o in n.output}
        sources = [made[made[out.name].input[0]].op_type for out in attr.g.output]  # each output's Identity input
        assert sources == ["FusedMatMul" if attr.name == "then_branch" else "ConcatFromSequence", "Where"], sources


@pytest.mark.parametrize("activation,gemms,glu_calls", [("situ", 2, {"SiTUGLUExperts": 1}),
                                                         ("silu", 3, {"SiTUGLUExperts": 0})])
def test_per_expert_step_has_no_branch_and_no_loop(activation, gemms, glu_calls):
    """Up to UNROLL_MAX fp32 experts the body has neither If nor Loop: one copy of the step per expert. With
    SiTU, each expert's w1 and w3 are one Gemm and every expert's GLU one k3x.fused::SiTUGLUExperts call; SiLU
    keeps two Gemms and its ops."""
    inputs = [ir.Value(name=n) for n in ("x", "z", "gate_weight", "gate_bias")] + weight_values(ir.DataType.FLOAT)
    fn, _ = moe_function(20, [ir.node("MoE", inputs, {"activation": activation, "num_experts": 8},
                                      domain=onnx_node.DOMAIN)])
    assert not {"If", "Loop"} & {n.op_type for n in fn.node}
    assert sum(n.op_type == "Gemm" for n in fn.node) == gemms * 8
    assert {op: sum(n.op_type == op for n in fn.node) for op in glu_calls} == glu_calls


def test_expert_weights_are_only_gathered_per_hit_expert():
    """Weights of unknown type: no batch; outside the Loop nothing reads w1/w3/w2; inside, only a Gather of one
    expert does."""
    import onnx_ir as ir

    fn, _ = moe_function(20, [ir.node("MoE", [], {"activation": "situ"}, domain=onnx_node.DOMAIN)])
    experts = ("w1", "w3", "w2")
    assert not [n.op_type for n in fn.node if set(n.input) & set(experts)]
    (loop,) = [n for n in fn.node if n.op_type == "Loop"]
    body = helper.get_attribute_value(loop.attribute[0])
    readers = [n for n in body.node if set(n.input) & set(experts)]
    assert sorted(n.input[0] for n in readers) == sorted(experts) and {n.op_type for n in readers} == {"Gather"}


@pytest.mark.parametrize("ep", [2, 4])
def test_expert_parallel_ranks_compute_their_share(ep):
    """Each rank's node holds E / ep experts from `expert_offset` on and routes over all E: its u is the
    reference's partial sum over the pairs routed to its experts, and the ranks' sum is the whole MoE."""
    E, k, d, L, I = 8, 3, 24, 16, 12
    w, n = weights(E, d, L, I), E // ep
    x, z = tokens(9, d, L, seed=3)
    parts = []
    for r in range(ep):
        local = {**w, **{name: w[name][r * n:(r + 1) * n] for name in ("w1", "w3", "w2")}}
        parts.append(MoESession(local, k, offset=r * n).check(x, z, f"rank {r} of {ep}"))
    assert_close(sum(parts), moe(x, z, *w.values(), k, 1.0, True, "situ", 4.0, 25.0), torch.float32, "sum of ranks")


def test_combine_weighs_and_sums_the_pair_rows_in_one_matmul(tmp_path):
    """Expert parallelism: a pair routed to another rank's expert gets weight 0 on the [M] pair weights; the
    combine (the k3x.fused::MoECombine body) reads the experts' [n_e, L] rows only by one Concat, a Gather and
    one MatMul (weights [N, 1, k] @ rows [N, k, L]): no Where masking them, no Mul and ReduceSum over them
    (each a pass, together ~3% of a k3-bench prefill). Decode and prefill stay equal to the reference's
    partial sum of the rank."""
    E, k, d, L, I = 16, 4, 24, 16, 12
    w = weights(E, d, L, I)
    w["gate_bias"] *= 0.2  # balanced routing
    local = {**w, **{name: w[name][8:] for name in ("w1", "w3", "w2")}}
    s = MoESession(local, k, offset=8, profile=str(tmp_path / "ort"))
    for N in (1, 64):
        s.check(*tokens(N, d, L, seed=N), f"rank 1 of 2, N={N}")
    events = s.nodes_run()
    assert "per_expert" in body_steps(events)
    wide = {e["args"]["op_name"] for e in events if "MoECombine/combine/" in e["name"]
            and any(list(t.values())[0][-1:] == [L] for t in e["args"].get("input_type_shape", []))}
    assert "MatMul" in wide and wide <= {"Shape", "Concat", "Gather", "Reshape", "MatMul", "Squeeze"}, wide
