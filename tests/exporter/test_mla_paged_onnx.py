"""k3::MLAPaged in ONNX (custom_ops/mla_paged/onnx.py): a tiny module calling torch.ops.k3.mla_paged goes
through torch.export and torch.onnx with the registry's translation table, gets the `ort` body, and one ONNX
Runtime session (N, B, MB, NB dynamic) matches the reference on decode-only, prefill and mixed steps; the
body reads the pool only through a Gather of the step's block table; the `trt` pass leaves the bare node."""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path

import onnx
import onnx_ir as ir
import pytest
import torch
from torch.export import Dim

import k3x.custom_ops  # noqa: F401  (registers torch.ops.k3.*)
from k3x.custom_ops.mla_paged import mla_paged
from k3x.custom_ops.mla_paged.onnx import NODE
from k3x.custom_ops.mla_paged.reference import mla_paged as reference
from k3x.exporter.onnx import translation_table
from k3x.exporter.onnx_flavors import ort_pass, trt_pass
from paged_cases import paged_case
from tolerances import assert_close

ort = pytest.importorskip("onnxruntime")

H, C, R, BS = 3, 12, 5, 4
NAMES = ("q_latent", "q_rope", "latent", "latent_pool", "block_table", "past_lens", "cu_seqlens")


class _Attention(torch.nn.Module):
    def forward(self, q_latent, q_rope, latent, latent_pool, block_table, past_lens, cu_seqlens):
        return mla_paged(q_latent, q_rope, latent, latent_pool, block_table, past_lens, cu_seqlens, scale=0.3)


def _inputs(seqs, seed=0):
    case = paged_case(seqs, BS, C + R, gen=torch.Generator().manual_seed(seed))
    gen = torch.Generator().manual_seed(seed + 1)
    N = case.latent.shape[0]
    return (torch.randn(N, H, C, generator=gen), torch.randn(N, H, R, generator=gen), case.latent,
            *(x.contiguous() for x in case.paged))


def _export() -> ir.Model:
    N, B, MB, NB = Dim("N", min=1), Dim("B", min=1), Dim("MB", min=1), Dim("NB", min=1)
    dims = {"q_latent": {0: N}, "q_rope": {0: N}, "latent": {0: N}, "latent_pool": {0: NB},
            "block_table": {0: B, 1: MB}, "past_lens": {0: B}, "cu_seqlens": {0: Dim("B1", min=2)}}
    ep = torch.export.export(_Attention(), _inputs([(6, 3), (0, 2)]), dynamic_shapes=dims, strict=False)
    return torch.onnx.export(ep, dynamo=True, custom_translation_table=translation_table(), optimize=False,
                             opset_version=23, verbose=False).model


@functools.cache
def session_proto() -> bytes:
    proto = ir.serde.serialize_model(ort_pass(_export()))
    onnx.checker.check_model(proto, full_check=True)
    return proto.SerializeToString()


@pytest.fixture(scope="module")
def session():
    return onnx.load_from_string(session_proto()), ort.InferenceSession(session_proto(),
                                                                        providers=["CPUExecutionProvider"])


@pytest.mark.parametrize("seqs", [
    pytest.param([(5, 1)], id="decode-1"),
    pytest.param([(9, 1), (0, 1), (4, 1), (16, 1)], id="decode-B4"),
    pytest.param([(0, 11)], id="prefill"),
    pytest.param([(0, 5), (0, 11), (0, 1)], id="prefill-B3"),
    pytest.param([(31, 1), (0, 1), (16, 3), (1, 1), (8, 8), (15, 2), (2, 13)], id="mixed-B7"),
    pytest.param([(5, 1), (9, 1), (0, 20)], id="decode-rows-and-a-first-chunk"),
    pytest.param([(0, 1), (0, 1), (7, 4)], id="first-tokens-and-a-chunk-with-past"),
    pytest.param([(5, 1), (3, 0), (2, 6)], id="a-row-less-sequence"),  # (a broken rollback's step)
])
def test_ort_body_matches_reference(session, seqs):
    _, sess = session
    args = _inputs(seqs, seed=len(seqs))
    feeds = {i.name: a.numpy() for i, a in zip(sess.get_inputs(), args)}
    (o,) = sess.run(None, feeds)
    assert_close(torch.from_numpy(o), reference(*args, 0.3), torch.float32, f"{seqs}")


def test_body_reads_the_pool_only_through_the_block_table(session):
    proto, _ = session
    (fn,) = [f for f in proto.functions if f.name == NODE.op_type]

    def nodes(graph_nodes) -> list:  # every node, If branches included
        return [m for n in graph_nodes for m in [n, *(x for a in n.attribute if a.g.node for x in nodes(a.g.node))]]

    every = nodes(fn.node)
    readers = [n.op_type for n in every if "latent_pool" in n.input]
    assert sorted(readers) == ["Gather"] * 3 + ["Shape"] * 6, readers  # the whole step, or each group of a split
    made = {o: n for n in every for o in n.output}
    for gather in (n for n in every if n.op_type == "Gather" and "latent_pool" in n.input):
        table = made[gather.input[1]]
        assert table.op_type == "Slice"  # the table's first blocks only: the step's or its group's rows of it
        assert table.input[0] == "block_table" or made[table.input[0]].input[0] == "block_table"


def test_decode_rows_beside_a_chunk_are_not_padded_to_it(tmp_path):
    """One-row sequences beside a longer one attend as their own group: no tensor of the run has the whole
    step's sequences padded to the chunk ([4, H, 20, ...]); the chunk's group is [1, H, 20, ...]."""
    events = profiled_nodes([(5, 1), (9, 1), (3, 1), (0, 20)], tmp_path)
    assert any("MLAPaged/split/" in e["name"] for e in events)
    shapes = [s for e in events for t in e["args"]["input_type_shape"] for s in t.values()]
    assert [1, H, 20, C + R] in shapes and not [s for s in shapes if len(s) == 4 and s[0] == 4 and s[2] == 20]


@pytest.mark.parametrize("seqs,blocks", [
    pytest.param([(0, 11)], 0, id="prefill-reads-no-block"),
    pytest.param([(5, 1), (0, 1), (12, 1)], 3, id="decode-reads-past-blocks-only"),  # the table has 4 (12 + 1 rows)
])
def test_body_gathers_only_the_blocks_holding_past_positions(seqs, blocks, tmp_path):
    """ORT's profile of the pool Gather: [B, ceil(max past / BS), BS, L], not the table's MB blocks (which also
    cover this step's rows): a prefill chunk with no past reads nothing from the pool."""
    shapes = [e["args"]["output_type_shape"][0]["float"] for e in profiled_nodes(seqs, tmp_path)
              if "MLAPaged/gather/Gather" in e["name"]]
    assert shapes == [[len(seqs), blocks, BS, C + R]], shapes


@pytest.mark.parametrize("seqs,branch", [
    pytest.param([(0, 5), (0, 11)], "prefill", id="no-past:prefill"),
    pytest.param([(0, 5), (3, 2)], "past", id="some-past:past"),
])
def test_step_without_past_softmaxes_its_own_scores_only(seqs, branch, tmp_path):
    """A step where no sequence has a past takes the If's `prefill` branch (no empty past block concatenated
    to the scores and split off again), any other the `past` one; the masks are additive: no Where runs
    over the [B, H, Tmax, keys] scores."""
    events = profiled_nodes(seqs, tmp_path)
    steps = {m.group(1) for e in events for m in [re.search(r"MLAPaged/(\w+)/", e["name"])] if m}
    assert branch in steps and not ({"prefill", "past"} - {branch}) & steps, steps
    wide = [e["name"] for e in events if e["args"]["op_name"] == "Where" and any(
        len(s) == 4 and s[1] == H for t in e["args"]["input_type_shape"] for s in t.values())]
    assert not wide, wide


def test_a_step_with_past_cuts_its_output_not_the_past_keys(tmp_path):
    """The past branch mixes the whole keys (C + R wide) and slices the [B, H, Tmax, C + R] sum to C: no
    Slice copies the past keys ([B, 1, P, C + R], P = the sequences' whole past) every step."""
    events = profiled_nodes([(40, 1), (3, 1), (17, 1)], tmp_path)
    sliced = [t for e in events if "MLAPaged/past/Slice" in e["name"] for t in e["args"]["input_type_shape"][:1]]
    assert sliced == [{"float": [3, H, 1, C + R]}], sliced


def profiled_nodes(seqs, tmp_path) -> list[dict]:
    """The kernel events of one ORT run of the body on `seqs` (checked against the reference)."""
    so = ort.SessionOptions()
    so.enable_profiling, so.profile_file_prefix = True, str(tmp_path / "ort")
    sess = ort.InferenceSession(session_proto(), so, providers=["CPUExecutionProvider"])
    args = _inputs(seqs, seed=5)
    (o,) = sess.run(None, {i.name: a.numpy() for i, a in zip(sess.get_inputs(), args)})
    assert_close(torch.from_numpy(o), reference(*args, 0.3), torch.float32, f"{seqs}")
    events = json.loads(Path(sess.end_profiling()).read_text())
    return [e for e in events if e.get("cat") == "Node" and e["name"].endswith("_kernel_time")]


def test_trt_pass_keeps_the_bare_node_with_its_fields():
    model = trt_pass(_export())
    (node,) = [n for n in model.graph if n.op_type == NODE.op_type]
    assert {f for f, _ in NODE.fields} <= set(node.attributes)
    assert [node.attributes[f].value for f in ("num_heads", "kv_lora_rank", "rope_dim", "block_size")] == [H, C, R, BS]
    assert not [k for k in model.functions if k[1] == NODE.op_type]
