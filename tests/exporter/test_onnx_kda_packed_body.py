"""The `ort` body of k3::KDAPacked (custom_ops/kda_packed/onnx.py `function`): a tiny module calling
torch.ops.k3.kda_packed, exported by torch.onnx (the family's translation), given the body by the ort pass
and run by onnxruntime, equals the packed reference for steps of other N and B than the one traced
(decode rows, prefill tails, mixed, permuted slots) through one session."""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path

import onnx
import onnx_ir as ir
import pytest
import torch

import k3x.custom_ops  # noqa: F401  (registers torch.ops.k3.*)
from k3x.custom_ops.kda_packed.reference import kda_packed
from k3x.exporter.onnx import translation_table
from k3x.exporter.onnx_flavors import ort_pass
from packed_steps import LayerStep, kda_layer, kda_step, layer_step
from tolerances import assert_close

ort = pytest.importorskip("onnxruntime")

H, K, V, S = 2, 16, 8, 9
NAMES = ("q", "k", "v", "g", "beta", "state_pool", "cu_seqlens", "slots")


class Packed(torch.nn.Module):
    def forward(self, q, k, v, g, beta, state_pool, cu_seqlens, slots):
        return torch.ops.k3.kda_packed(q, k, v, g, beta, state_pool, cu_seqlens, slots, K ** -0.5, "reference", -5.0)


@functools.cache
def body_proto() -> bytes:
    from torch.export import Dim

    N, B = Dim("N", min=1, max=4096), Dim("B", min=1, max=S)
    shapes = {n: {0: N} for n in NAMES[:5]} | {"state_pool": {0: Dim("S", min=1, max=64)},
                                                "cu_seqlens": {0: B + 1}, "slots": {0: B}}
    ep = torch.export.export(Packed(), kda_step([5, 1, 3], H=H, K=K, V=V, S=S), dynamic_shapes=shapes)
    prog = torch.onnx.export(ep, dynamic_shapes=shapes, dynamo=True, custom_translation_table=translation_table(),
                             opset_version=20, optimize=False, verbose=False)
    assert [n.op_type for n in prog.model.graph] == ["KDAPacked"]
    proto = ir.serde.serialize_model(ort_pass(prog.model))
    onnx.checker.check_model(proto, full_check=True)
    return proto.SerializeToString()


@pytest.fixture(scope="module")
def session():
    return ort.InferenceSession(body_proto(), providers=["CPUExecutionProvider"])


@pytest.mark.parametrize("lens", [
    pytest.param([1], id="one-decode-row"),
    pytest.param([1, 1, 1, 1, 1, 1, 1], id="decode-B7"),
    pytest.param([70], id="one-prefill"),
    pytest.param([2, 65, 1, 15, 64], id="mixed"),
])
def test_body_matches_reference(session, lens):
    args = kda_step(lens, H=H, K=K, V=V, S=S, seed=len(lens))
    o, s = session.run(None, {n: x.numpy() for n, x in zip(NAMES, args)})
    ro, rs = kda_packed(*args, scale=K ** -0.5)
    assert_close(torch.from_numpy(o), ro, torch.float32, f"{lens}: o")
    assert_close(torch.from_numpy(s), rs, torch.float32, f"{lens}: final_state")


@pytest.mark.parametrize("lens,branch", [
    pytest.param([70], "even", id="one-prefill:even"),
    pytest.param([1, 1, 1], "even", id="decode-B3:even"),
    pytest.param([2, 65, 1], "split", id="decode-rows-and-chunks:split"),
    pytest.param([1, 1, 1, 1, 1, 40], "split", id="decode-B5-and-a-chunk:split"),
    pytest.param([2, 65, 3], "ragged", id="chunks:ragged"),
    pytest.param([1, 0, 5], "ragged", id="a-row-less-sequence:ragged"),  # (a broken rollback's step)
])
def test_each_step_takes_its_branch(lens, branch, tmp_path):
    """A step whose sequences all have the same length (one prefill, decode rows only) takes the If's
    `even` branch: the packed rows are the [B, L] grid, no padding Gather of q, k, v, g, beta, no masking Mul,
    no unpacking Gather of o; one-row sequences beside longer ones the `split` one (two recurrences, only the
    longer sequences padded); other steps the `ragged` one. All equal the reference."""
    ran = profiled_steps(kda_step(lens, H=H, K=K, V=V, S=S, seed=3), tmp_path)
    steps = {step for step, _ in ran}
    assert branch in steps and not ({"even", "split", "ragged"} - {branch}) & steps, steps
    gathers = {step for step, op in ran if op == "Gather"}  # pad: the pool's B rows
    want = {"even": {"pad"}, "split": {"split", "unpack"}, "ragged": {"pad", "ragged", "unpack"}}[branch]
    assert gathers == want, ran
    assert (branch != "even") == any(op == "Mul" for step, op in ran if step != "recurrence"), ran


def test_both_branches_hand_out_what_the_recurrence_writes():
    """The Ifs' branches each run the recurrence and return its outputs (the even one o as written, [B, L,
    H*V]): a branch output made by a Reshape or Identity of a step-sized input (or of the pool) would be
    copied into the If's output, a pass over the rows the branches exist to avoid. The inner If of each
    branch reads the pool itself (then) or a Gather of its rows (else)."""
    from k3x.custom_ops.kda_packed.onnx import function

    fn, _ = function(20, [])
    (node,) = [n for n in fn.node if n.op_type == "If"]

    def sources(g: onnx.GraphProto) -> list[str]:  # each output's producer, through the branch's Identity
        made = {o: n for n in g.node for o in n.output}
        return [made[made[out.name].input[0]] for out in g.output]

    def check(branch: onnx.GraphProto, name: str) -> None:  # the even or ragged branch
        outs = sources(branch)
        assert [n.op_type for n in outs] == (["If", "If"] if name == "even" else ["Gather", "If"])
        for inner in outs[-1].attribute:
            las = sources(inner.g)
            assert [n.op_type for n in las] == ["LinearAttention"] * 2, (name, inner.name)
            pool = las[0].input[3]
            assert (pool == "state_pool") == (inner.name == "then_branch"), (name, inner.name, pool)

    branches = {attr.name: attr.g for attr in node.attribute}
    even, uneven = branches["then_branch"], branches["else_branch"]
    check(even, "even")
    (mixed,) = [n for n in uneven.node if n.op_type == "If"]
    split, ragged = ({a.name: a.g for a in mixed.attribute}[k] for k in ("then_branch", "else_branch"))
    check(ragged, "ragged")
    assert [n.op_type for n in sources(split)] == ["Gather", "Gather"]  # o and the states put back in step order
    assert sum(n.op_type == "LinearAttention" for n in split.node) == 2


@pytest.mark.parametrize("lens, in_order, gathers", [
    pytest.param([1, 1, 1, 1], True, set(), id="full-decode"),
    pytest.param([3, 4, 70, 2], True, {"ragged", "unpack"}, id="full-ragged"),
    pytest.param([3, 1, 70, 2], True, {"split", "unpack"}, id="full-split"),  # each group's rows gathered
    pytest.param([1, 1, 1, 1], False, {"pad"}, id="full-permuted"),
])
def test_a_step_holding_every_slot_in_order_reads_the_pool_itself(tmp_path, lens, in_order, gathers):
    """B = S and slots 0..S-1: no Gather of the pool's rows (the `pad` step's), the recurrence reads the pool."""
    args = list(kda_step(lens, H=H, K=K, V=V, S=len(lens), seed=3))
    args[7] = torch.arange(len(lens), dtype=torch.int32) if in_order else torch.tensor([1, 0, 2, 3], dtype=torch.int32)
    ran = profiled_steps(args, tmp_path)
    assert {step for step, op in ran if op == "Gather"} == gathers, ran


def profiled_steps(args, tmp_path) -> set[tuple[str, str]]:
    """One profiled ORT run of the body on `args` (checked against the reference) -> the (body step, op type)
    of every node kernel that ran."""
    so = ort.SessionOptions()
    so.enable_profiling, so.profile_file_prefix = True, str(tmp_path / "ort")
    sess = ort.InferenceSession(body_proto(), so, providers=["CPUExecutionProvider"])
    o, s = sess.run(None, {n: x.numpy() for n, x in zip(NAMES, args)})
    ro, rs = kda_packed(*args, scale=K ** -0.5)
    lens = (args[6][1:] - args[6][:-1]).tolist()
    assert_close(torch.from_numpy(o), ro, torch.float32, f"{lens}: o")
    assert_close(torch.from_numpy(s), rs, torch.float32, f"{lens}: final_state")
    events = [e for e in json.loads(Path(sess.end_profiling()).read_text()) if e.get("cat") == "Node"]
    return {(m.group(1), e["args"]["op_name"]) for e in events
            for m in [re.search(r"KDAPacked/(\w+)/", e["name"])] if m and e["name"].endswith("_kernel_time")}


def test_packed_layer_runs_in_onnxruntime():
    """KimiDeltaAttention.forward_packed (packed conv by gathers + k3::KDAPacked) exported to ONNX, ort
    flavor: equals the eager layer for a step of other N and B than traced."""
    from torch.export import Dim

    m = kda_layer()
    N, B, P = Dim("N", min=1, max=4096), Dim("B", min=1, max=64), Dim("S", min=1, max=64)
    shapes = {"x": {0: N}, "conv_pool": {0: P}, "rec_pool": {0: P}, "cu_seqlens": {0: B + 1}, "slots": {0: B}}
    with torch.no_grad():
        ep = torch.export.export(LayerStep(m), layer_step(m, [5, 1, 3]), dynamic_shapes=shapes)
    prog = torch.onnx.export(ep, dynamic_shapes=shapes, dynamo=True, custom_translation_table=translation_table(),
                             opset_version=20, verbose=False)
    proto = ir.serde.serialize_model(ort_pass(prog.model))
    sess = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    for lens in ([1], [70, 1, 2, 1]):
        args = layer_step(m, lens, S=6, seed=7)
        got = sess.run(None, {i.name: a.numpy() for i, a in zip(sess.get_inputs(), args)})
        with torch.no_grad():
            want = LayerStep(m)(*args)
        for what, a, b in zip(("y", "new conv", "new recurrent"), got, want):
            assert_close(torch.from_numpy(a), b, torch.float32, f"{lens}: {what}")
