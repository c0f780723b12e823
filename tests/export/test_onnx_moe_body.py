"""The `ort` body of k3::MoE (custom_ops/moe/onnx.py `function`): sparse (a Loop over the hit experts
only) and exact against custom_ops/moe/reference.py under the tolerance table, for random routing, decode and
prefill through one session (dynamic N), an expert hit by every token, top_k = E, top_k = 1, and bf16
expert weights stored as initializers (as in an exported model).
"""

from __future__ import annotations

import onnx
import onnx_ir as ir
import pytest
import torch
from onnx import TensorProto, helper

from k3x.custom_ops.moe.onnx import function as moe_function
from k3x.custom_ops.moe.reference import moe
from k3x.export.onnx_flavors import ort_pass
from k3x.plan import onnx_node
from tolerances import assert_close

ort = pytest.importorskip("onnxruntime")

ONNX_TYPE = {torch.float32: TensorProto.FLOAT, torch.bfloat16: TensorProto.BFLOAT16}


def initializer(name: str, t: torch.Tensor) -> onnx.TensorProto:
    raw = t.contiguous().view(torch.int16 if t.dtype == torch.bfloat16 else t.dtype).numpy().tobytes()
    return helper.make_tensor(name, ONNX_TYPE[t.dtype], list(t.shape), raw, raw=True)


def weights(E: int, d: int, L: int, I: int, dtype=torch.float32, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"gate_weight": torch.randn(E, d, generator=g) * 0.3, "gate_bias": torch.randn(E, generator=g) * 0.1,
            "w1": (torch.randn(E, I, L, generator=g) * 0.3).to(dtype),
            "w3": (torch.randn(E, I, L, generator=g) * 0.3).to(dtype),
            "w2": (torch.randn(E, L, I, generator=g) * 0.3).to(dtype)}


class MoESession:
    """One k3::MoE node over the `ort` pass: x [N, d], z [N, L] fp32 inputs (N dynamic), weights as initializers."""

    def __init__(self, w: dict[str, torch.Tensor], top_k: int, activation: str = "situ", renormalize: bool = True,
                 factor: float = 1.0, offset: int | None = None):
        E, I, L = w["w1"].shape
        d = w["gate_weight"].shape[1]
        self.w, self.args = w, (top_k, factor, renormalize, activation, 4.0, 25.0)
        self.offset = None if offset is None else torch.tensor([offset], dtype=torch.int32)
        inits = [initializer(n, t) for n, t in w.items()]
        inits.append(helper.make_tensor("expert_offset", TensorProto.INT32, [1], [offset or 0]))
        node = helper.make_node(
            "MoE", ["x", "z", *w, "expert_offset"], ["u"], domain=onnx_node.DOMAIN, top_k=top_k, routed_scaling_factor=factor,
            renormalize=int(renormalize), activation=activation, situ_beta=4.0, situ_linear_beta=25.0,
            num_experts=E, hidden_size=d, expert_dim=L, intermediate_size=I, **onnx_node.COMMON_ATTRIBUTES)
        graph = helper.make_graph(
            [node], "moe",
            [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", d]),
             helper.make_tensor_value_info("z", TensorProto.FLOAT, ["N", L])],
            [helper.make_tensor_value_info("u", TensorProto.FLOAT, ["N", L])],
            initializer=inits)
        proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20), helper.make_opsetid("k3", 1)],
                                  ir_version=10)
        proto = ir.serde.serialize_model(ort_pass(ir.serde.deserialize_model(proto)))
        onnx.checker.check_model(proto, full_check=True)
        self.sess = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])

    def check(self, x: torch.Tensor, z: torch.Tensor, what: str) -> torch.Tensor:
        (u,) = self.sess.run(None, {"x": x.numpy(), "z": z.numpy()})
        assert_close(torch.from_numpy(u), moe(x, z, *self.w.values(), *self.args, self.offset), torch.float32, what)
        return torch.from_numpy(u)


def tokens(N: int, d: int, L: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(N, d, generator=g), torch.randn(N, L, generator=g)


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


def test_expert_weights_are_only_gathered_per_hit_expert():
    """No dense path: outside the Loop nothing reads w1/w3/w2; inside, only a Gather of one expert does."""
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
