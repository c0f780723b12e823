"""The k3 ops' ONNX Runtime CPU kernels (runtime/ort_kernels.py): built from source (g++, ONNX Runtime's
installed headers) into this module's own cache, each kernel checked against its family's
reference in a model that has no function body beside the node (so the kernel, not a body, ran), and a
serving step with the library loaded equal to the same step on the function bodies."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from onnx import TensorProto, helper

from k3x.custom_ops.attn_res.reference import attn_res
from k3x.custom_ops.moe.reference import glu
from ort_kernel_models import bare, session


def _attn_res_model(eps: float):
    return bare("AttnRes", ("prefix", "bank", "norm_weight", "proj_weight"), ["out"], eps=eps, hidden_size=0)


def test_without_the_library_the_bare_node_does_not_load():
    with pytest.raises(Exception, match="AttnRes"):
        session(_attn_res_model(1e-5))


@pytest.mark.parametrize("rows,n,d,scale", [((1,), 1, 1, 1.0), ((5,), 3, 7, 1.0), ((2, 3), 8, 64, 1.0),
                                            ((37,), 2, 1030, 1.0), ((4,), 5, 96, 40.0)])
def test_attn_res_kernel_matches_the_reference(kernels, rows, n, d, scale):
    g = torch.Generator().manual_seed(sum(rows) * 131 + n * 7 + d)
    prefix = torch.randn(*rows, d, generator=g) * scale
    bank = torch.randn(*rows, n, d, generator=g) * scale
    norm, proj = 1 + 0.1 * torch.randn(d, generator=g), torch.randn(d, generator=g) / d ** 0.5
    out = session(_attn_res_model(1e-5), kernels).run(None, {"prefix": prefix.numpy(), "bank": bank.numpy(),
                                                               "norm_weight": norm.numpy(), "proj_weight": proj.numpy()})[0]
    want = attn_res(prefix.double(), bank.double(), norm.double(), proj.double(), 1e-5)
    assert out.shape == tuple(prefix.shape)
    np.testing.assert_allclose(out, want.numpy(), rtol=1e-5, atol=1e-5 * scale)


def test_attn_res_kernel_names_a_bank_that_does_not_match(kernels):
    feeds = {"prefix": np.zeros((3, 8), np.float32), "bank": np.zeros((3, 2, 9), np.float32),
             "norm_weight": np.ones(8, np.float32), "proj_weight": np.ones(8, np.float32)}
    with pytest.raises(Exception, match=r"k3::AttnRes: bank \[3, 2, 9\] does not match prefix \[3, 8\]"):
        session(_attn_res_model(1e-5), kernels).run(None, feeds)


def test_a_serving_step_on_the_kernels_equals_the_function_bodies(kernels, serving_export, monkeypatch, tmp_path):
    import json

    from k3x.bench.serving_steps import StepCase, kernel_nodes, open_serving

    outs, ran = [], []
    for use in ("0", "1"):
        monkeypatch.setenv("K3X_ORT_KERNELS", use)
        runner, cfg, bs = open_serving(serving_export, 1, profile=str(tmp_path / f"kernels-{use}"))
        case = StepCase(cfg, batch=3, positions=16, capacity=16, block_size=bs, seed=3)
        feeds = case.feeds(5, 0)
        feeds["cu_seqlens"] = torch.tensor([0, 1, 9, 15], dtype=torch.int32)  # a decode row beside two chunks
        feeds["logits_index"] = feeds["cu_seqlens"][1:].long() - 1
        outs.append(runner.infer(feeds))
        events = json.loads(Path(runner.session.end_profiling()).read_text())
        ran.append({e["args"]["op_name"] for e in kernel_nodes(events)})
    for op in ("AttnRes", "KDAPrep", "KDAPacked", "SiTUGLU", "SiTUGLUExperts", "MLAPaged"):  # kernels, not bodies
        assert op not in ran[0] and op in ran[1], (op, ran)
    for name, want in outs[0].items():
        torch.testing.assert_close(torch.as_tensor(outs[1][name]), torch.as_tensor(want), rtol=1e-5, atol=1e-5,
                                   msg=lambda m, name=name: f"{name}: {m}")


def test_the_command_reports_the_library_and_names_a_missing_compiler(kernels, monkeypatch):
    from typer.testing import CliRunner

    from k3x.cli import app

    from k3x.runtime.ort_kernels import sources

    r = CliRunner().invoke(app, ["build-ort-kernels"])
    assert r.exit_code == 0 and f"{kernels}: kernels of the op families {', '.join(sources())}" in r.output, r.output
    assert {"kda", "attn_res", "moe", "linear_q8"} <= set(sources())
    monkeypatch.setenv("CXX", "no-such-compiler")
    r = CliRunner().invoke(app, ["build-ort-kernels"])
    assert r.exit_code == 1 and "'no-such-compiler' is not on PATH" in r.output, r.output


def _kda_prep_model(H: int, K: int, V: int, W: int, lb: float):
    from k3x.custom_ops.kda_prep.onnx import NODE

    return bare("KDAPrep", [n for n, _ in NODE.inputs], [n for n, _ in NODE.outputs], num_heads=H, head_dim=K,
                 value_dim=V, conv_kernel=W, gate_lower_bound=lb)


def _kda_prep_inputs(lens: list[int], H: int, K: int, V: int, W: int, scale: float, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    N, C, B = sum(lens), 2 * H * K + H * V, len(lens)
    slots = torch.randperm(B + 3, generator=g)[:B].to(torch.int32)  # a permutation with spare rows
    return {"qkv": torch.randn(N, C, generator=g) * scale, "f": torch.randn(N, H, K, generator=g) * 2,
            "b": torch.randn(N, H, generator=g) * 2, "conv_weight": torch.randn(C, W, generator=g) / W ** 0.5,
            "A_log": torch.randn(H + 1, generator=g), "dt_bias": torch.randn(H * K, generator=g),
            "conv_pool": torch.randn(B + 3, C, W - 1, generator=g) * scale,
            "cu_seqlens": torch.tensor([0, *np.cumsum(lens)], dtype=torch.int32), "slots": slots}


@pytest.mark.parametrize("lens,H,K,V,W,lb,scale", [
    ([1], 1, 16, 16, 4, -5.0, 1.0),  # one decode row
    ([5, 1, 2, 37, 1], 2, 16, 32, 4, -5.0, 1.0),  # chunks, decode rows, a sequence shorter than W - 1
    ([3, 0, 9], 3, 8, 8, 3, 0.0, 40.0),  # an empty sequence keeps its state; Kimi Linear's gate; large inputs
    ([64], 2, 128, 128, 4, -5.0, 1.0),  # one prefill chunk at K3's head size
])
def test_kda_prep_kernel_matches_the_reference(kernels, lens, H, K, V, W, lb, scale):
    from k3x.custom_ops.kda_prep.onnx import NODE
    from k3x.custom_ops.kda_prep.reference import kda_prep

    x = _kda_prep_inputs(lens, H, K, V, W, scale, seed=sum(lens) + H + W)
    out = session(_kda_prep_model(H, K, V, W, lb), kernels).run(None, {n: t.numpy() for n, t in x.items()})
    want = kda_prep(*(t.double() if n == "qkv" else t for n, t in x.items()), gate_lower_bound=lb)
    for (name, _), got, e in zip(NODE.outputs, out, want):
        assert got.shape == tuple(e.shape), name
        np.testing.assert_allclose(got, e.float().numpy(), rtol=1e-5, atol=1e-5 * scale, err_msg=name)


@pytest.mark.parametrize("change,message", [
    ({"f": np.zeros((4, 2, 15), np.float32)}, r"k3::KDAPrep: f \[4, 2, 15\]: expected \[N, H, K\]"),
    ({"cu_seqlens": np.array([0, 3, 2], np.int32)}, r"cu_seqlens must rise from 0 to N = 4"),
    ({"slots": np.array([0, 5], np.int32)}, r"slot 5 outside the pool of 5"),
])
def test_kda_prep_kernel_names_the_bad_input(kernels, change, message):
    feeds = {n: t.numpy() for n, t in _kda_prep_inputs([3, 1], 2, 16, 16, 4, 1.0, seed=0).items()} | change
    with pytest.raises(Exception, match=message):
        session(_kda_prep_model(2, 16, 16, 4, -5.0), kernels).run(None, feeds)


def _situ_glu_model():
    return bare("SiTUGLU", ("a", "u", "beta", "linear_beta"), ["y"], domain="k3x.fused")


@pytest.mark.parametrize("shape,scale,betas", [((1,), 1.0, (4.0, 25.0)), ((7,), 1e-3, (4.0, 25.0)),
                                               ((3, 5), 1.0, (1.5, 0.5)), ((2, 16389), 3.0, (4.0, 25.0)),
                                               ((1, 9, 40), 60.0, (4.0, 25.0)), ((0, 8), 1.0, (4.0, 25.0))])
def test_situ_glu_kernel_matches_the_reference(kernels, shape, scale, betas):
    g = torch.Generator().manual_seed(sum(shape) + int(scale))
    a, u = (torch.randn(*shape, generator=g) * scale for _ in range(2))  # 60: tanh and sigmoid saturate
    feeds = {"a": a.numpy(), "u": u.numpy(), "beta": np.array(betas[0], np.float32),
             "linear_beta": np.array(betas[1], np.float32)}
    (y,) = session(_situ_glu_model(), kernels).run(None, feeds)
    want = glu(a.double(), u.double(), "situ", *betas)
    assert y.shape == shape
    np.testing.assert_allclose(y, want.numpy(), rtol=2e-6, atol=1e-6 * scale * scale)


@pytest.mark.parametrize("rows,I", [
    ((5, 0, 37, 1), 24),  # an expert without rows
    ((300,), 16),  # tasks of many rows
    ((2, 3), 4097),  # rows wider than a task
])
def test_situ_glu_experts_kernel_matches_the_reference(kernels, rows, I):
    names = [f"h_{e}" for e in range(len(rows))]
    model = bare("SiTUGLUExperts", ("beta", "linear_beta", *names), [f"y_{e}" for e in range(len(rows))],
                 domain="k3x.fused")
    g = torch.Generator().manual_seed(sum(rows) + I)
    hs = [torch.randn(r, 2 * I, generator=g) * 3 for r in rows]
    feeds = {"beta": np.array([4.0], np.float32), "linear_beta": np.array([25.0], np.float32)}
    ys = session(model, kernels).run(None, feeds | {n: h.numpy() for n, h in zip(names, hs)})
    for h, y in zip(hs, ys, strict=True):
        want = glu(h[:, :I].double(), h[:, I:].double(), "situ", 4.0, 25.0)
        np.testing.assert_allclose(y, want.numpy(), rtol=1e-5, atol=1e-6)


def test_situ_glu_experts_kernel_names_the_bad_input(kernels):
    model = bare("SiTUGLUExperts", ("beta", "linear_beta", "h_0", "h_1"), ["y_0", "y_1"], domain="k3x.fused")
    feeds = {"beta": np.array([4.0], np.float32), "linear_beta": np.array([25.0], np.float32),
             "h_0": np.zeros((3, 8), np.float32), "h_1": np.zeros((2, 7), np.float32)}
    with pytest.raises(Exception, match=r"k3x.fused::SiTUGLUExperts: h_1 \[2, 7\]: expected \[rows, 2I\]"):
        session(model, kernels).run(None, feeds)


def test_situ_glu_kernel_names_the_bad_input(kernels):
    feeds = {"a": np.zeros((3, 8), np.float32), "u": np.zeros((3, 9), np.float32), "beta": np.array(4, np.float32),
             "linear_beta": np.array(25, np.float32)}
    with pytest.raises(Exception, match=r"k3x.fused::SiTUGLU: a \[3, 8\] and u \[3, 9\]: expected one shape"):
        session(_situ_glu_model(), kernels).run(None, feeds)
    feeds |= {"u": np.zeros((3, 8), np.float32), "beta": np.ones(2, np.float32)}
    with pytest.raises(Exception, match=r"k3x.fused::SiTUGLU: beta \[2\]: expected one value"):
        session(_situ_glu_model(), kernels).run(None, feeds)


def _kda_packed_model(H: int, K: int, V: int, scale: float):
    from k3x.custom_ops.kda_packed.onnx import NODE

    return bare("KDAPacked", [n for n, _ in NODE.inputs], [n for n, _ in NODE.outputs], scale=scale, num_heads=H,
                 head_dim=K, value_dim=V, gate_lower_bound=-5.0)


def _kda_packed_inputs(lens: list[int], H: int, K: int, V: int, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    N, B = sum(lens), len(lens)
    unit = lambda *s: torch.nn.functional.normalize(torch.randn(*s, generator=g), dim=-1)  # noqa: E731
    return {"q": unit(N, H, K), "k": unit(N, H, K), "v": torch.randn(N, H, V, generator=g),
            "g": -5 * torch.rand(N, H, K, generator=g), "beta": torch.rand(N, H, generator=g),
            "state_pool": torch.randn(B + 3, H, K, V, generator=g),
            "cu_seqlens": torch.tensor([0, *np.cumsum(lens)], dtype=torch.int32),
            "slots": torch.randperm(B + 3, generator=g)[:B].to(torch.int32)}


@pytest.mark.parametrize("lens,H,K,V", [
    ([1], 1, 16, 16),  # one decode row
    ([5, 1, 2, 70, 1], 2, 8, 24),  # chunks beside decode rows (70 > the reference's 64-row chunk)
    ([3, 0, 9], 3, 7, 5),  # an empty sequence keeps its state; odd head sizes
    ([64, 1], 2, 128, 128),  # a prefill chunk and a decode row at K3's head size
    ([1, 4, 1], 2, 16, 40),  # decode rows over a full column block (its own path) and a partial one (AVX2)
])
def test_kda_packed_kernel_matches_the_reference(kernels, lens, H, K, V):
    from k3x.custom_ops.kda_packed.onnx import NODE
    from k3x.custom_ops.kda_packed.reference import kda_packed

    x = _kda_packed_inputs(lens, H, K, V, seed=sum(lens) + H + K)
    scale = K ** -0.5
    out = session(_kda_packed_model(H, K, V, scale), kernels).run(None, {n: t.numpy() for n, t in x.items()})
    want = kda_packed(*(t.double() if t.is_floating_point() else t for t in x.values()), scale=scale)
    for (name, _), got, e in zip(NODE.outputs, out, want, strict=True):
        assert got.shape == tuple(e.shape), name
        np.testing.assert_allclose(got, e.numpy(), rtol=1e-4, atol=1e-4, err_msg=name)


def test_kda_packed_two_rows_in_one_step_equal_two_one_row_steps_bit_for_bit(kernels):
    """A sequence's rows in one step (how speculation verifies drafts) and one row a step (plain decoding) give
    the same outputs and state to the bit: the kernel's one-row path (a full column block, K = V = 128) does the
    multi-row sweeps' arithmetic."""
    H, K, V = 2, 128, 128
    x = {n: t.numpy() for n, t in _kda_packed_inputs([2], H, K, V, seed=5).items()}
    run = session(_kda_packed_model(H, K, V, K ** -0.5), kernels).run
    o, final = run(None, x)
    pool, state = x["state_pool"].copy(), None
    for t in range(2):
        rows = {n: x[n][t: t + 1] for n in ("q", "k", "v", "g", "beta")}
        step_o, state = run(None, {**x, **rows, "state_pool": pool, "cu_seqlens": np.array([0, 1], np.int32)})
        assert np.array_equal(step_o[0], o[t]), f"row {t}: o differs from the two-row step"
        pool[x["slots"][0]] = state[0]
    assert np.array_equal(state, final), "the state after two one-row steps differs from the two-row step's"


@pytest.mark.parametrize("change,message", [
    ({"g": np.zeros((4, 2, 15), np.float32)}, r"k3::KDAPacked: k \[4, 2, 16\] and g \[4, 2, 15\]: expected q's"),
    ({"cu_seqlens": np.array([0, 3, 2], np.int32)}, r"cu_seqlens must rise from 0 to N = 4"),
    ({"slots": np.array([0, 5], np.int32)}, r"slot 5 outside the pool of 5"),
])
def test_kda_packed_kernel_names_the_bad_input(kernels, change, message):
    feeds = {n: t.numpy() for n, t in _kda_packed_inputs([3, 1], 2, 16, 16, seed=0).items()} | change
    with pytest.raises(Exception, match=message):
        session(_kda_packed_model(2, 16, 16, 0.25), kernels).run(None, feeds)


@pytest.mark.parametrize("E,N,top_k,ep,activation", [
    (16, 1, 4, 1, "situ"), (16, 48, 4, 1, "situ"), (16, 5, 16, 1, "situ"), (16, 2, 1, 1, "silu"),
    (8, 9, 3, 2, "situ"), (64, 3, 4, 1, "situ"), (16, 130, 4, 4, "silu")])
def test_moe_dispatch_and_combine_kernels_run_the_moe_node_as_the_reference(kernels, E, N, top_k, ep, activation,
                                                                            tmp_path):
    """A k3::MoE node with per-expert fp32 experts (its body calls k3x.fused::MoEDispatch and MoECombine) on
    the library: the two kernels ran in place of their bodies, and each expert-parallel rank's u equals the
    reference's partial sum (an expert without pairs, top_k = E, top_k = 1, 130 tokens over 4 ranks)."""
    import json

    import onnxruntime as ort

    from k3x.custom_ops.moe.reference import moe
    from moe_models import moe_model, tokens, weights
    from tolerances import assert_close

    d, L, I = 24, 20, 12
    w, n = weights(E, d, L, I, seed=E + N), E // ep
    x, z = tokens(N, d, L, seed=N)
    for r in range(ep):
        local = {**w, **{name: w[name][r * n:(r + 1) * n] for name in ("w1", "w3", "w2")}}
        so = ort.SessionOptions()
        so.register_custom_ops_library(str(kernels))
        so.enable_profiling, so.profile_file_prefix = True, str(tmp_path / f"rank{r}")
        sess = ort.InferenceSession(moe_model(local, top_k, activation, True, 1.5, r * n).SerializeToString(), so,
                                    providers=["CPUExecutionProvider"])
        (u,) = sess.run(None, {"x": x.numpy(), "z": z.numpy()})
        want = moe(x, z, *local.values(), top_k, 1.5, True, activation, 4.0, 25.0,
                   torch.tensor([r * n], dtype=torch.int32))  # the rank's partial sum
        events = [e for e in json.loads(Path(sess.end_profiling()).read_text()) if e.get("cat") == "Node"]
        ops = {e["args"]["op_name"] for e in events}
        assert {"MoEDispatch", "MoECombine"} <= ops and not any("MoEDispatch/" in e["name"] for e in events), ops
        assert_close(torch.from_numpy(u), want, torch.float32, f"E={E} N={N} k={top_k} rank {r} of {ep}")


def _dispatch_model(experts: int, library: bool):
    """One MoEDispatch call, its function body attached (run by ONNX Runtime's ops without the library)."""
    from k3x.custom_ops.moe.onnx_dispatch import DISPATCH_INPUTS, dispatch_function

    types = {"top_k": TensorProto.INT64, "num_experts": TensorProto.INT64, "expert_offset": TensorProto.INT32}
    outs = ["pair_w", "pair_row", *(f"x_{e}" for e in range(experts))]
    node = helper.make_node("MoEDispatch", list(DISPATCH_INPUTS), outs, domain="k3x.fused")
    graph = helper.make_graph([node], "dispatch", [helper.make_tensor_value_info(n, types.get(n, TensorProto.FLOAT), None)
                                                   for n in DISPATCH_INPUTS],
                              [helper.make_tensor_value_info(n, TensorProto.INT64 if n == "pair_row" else TensorProto.FLOAT,
                                                             None) for n in outs])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20), helper.make_opsetid("k3x.fused", 1)],
                              ir_version=10, functions=[dispatch_function(20, experts)])
    return model


@pytest.mark.parametrize("N,E,local,k,offset,r", [(1, 16, 16, 4, 0, 1.0), (37, 16, 16, 4, 0, 0.0),
                                                  (20, 16, 4, 3, 8, 1.0), (6, 8, 8, 8, 0, 1.0), (11, 5, 5, 1, 0, 0.0)])
def test_moe_dispatch_kernel_equals_its_body(kernels, N, E, local, k, offset, r):
    """Every output of the MoEDispatch kernel against its function body: the pairs' rows of Y and the
    experts' rows of z exactly (the same stable expert order), the pairs' weights to fp32 rounding."""
    g = torch.Generator().manual_seed(N * 31 + E)
    feeds = {"logits": torch.randn(N, E, generator=g).numpy(), "gate_bias": (0.1 * torch.randn(E, generator=g)).numpy(),
             "z": torch.randn(N, 7, generator=g).numpy(), "renormalize": np.array(r, np.float32),
             "scale": np.array(2.5, np.float32), "top_k": np.array([k]), "num_experts": np.array([local]),
             "expert_offset": np.array([offset], np.int32)}
    body = session(_dispatch_model(local, False)).run(None, feeds)
    kernel = session(_dispatch_model(local, True), kernels).run(None, feeds)
    np.testing.assert_allclose(kernel[0], body[0], rtol=1e-6, atol=1e-7)
    for got, want in zip(kernel[1:], body[1:], strict=True):
        assert got.shape == want.shape and np.array_equal(got, want)


def test_moe_kernels_name_the_bad_input(kernels):
    feeds = {"logits": np.zeros((3, 8), np.float32), "gate_bias": np.zeros(8, np.float32),
             "z": np.zeros((3, 4), np.float32), "renormalize": np.array(1, np.float32),
             "scale": np.array(1, np.float32), "top_k": np.array([9]), "num_experts": np.array([8]),
             "expert_offset": np.array([0], np.int32)}
    with pytest.raises(Exception, match=r"k3x.fused::MoEDispatch: top_k 9 outside 1..8"):
        session(_dispatch_model(8, True), kernels).run(None, feeds)
    feeds |= {"top_k": np.array([2]), "num_experts": np.array([6])}
    with pytest.raises(Exception, match=r"k3x.fused::MoEDispatch: num_experts 6 but 8 expert outputs"):
        session(_dispatch_model(8, True), kernels).run(None, feeds)
    combine = bare("MoECombine", ("pair_w", "pair_row", "y_0", "y_1"), ["u"], domain="k3x.fused")
    combine.graph.input[1].type.tensor_type.elem_type = TensorProto.INT64
    feeds = {"pair_w": np.ones((2, 2), np.float32), "pair_row": np.array([[0, 1], [2, 4]]),
             "y_0": np.ones((1, 5), np.float32), "y_1": np.ones((2, 5), np.float32)}
    with pytest.raises(Exception, match=r"k3x.fused::MoECombine: pair_row 4 outside the 4 rows of Y"):
        session(combine, kernels).run(None, feeds)
    feeds |= {"pair_row": np.array([[0, 1], [2, 3]]), "y_1": np.ones((2, 6), np.float32)}
    with pytest.raises(Exception, match=r"k3x.fused::MoECombine: y_1 \[2, 6\]: expected \[rows, 5\]"):
        session(combine, kernels).run(None, feeds)


def _conv_model(C: int, W: int, body: bool):
    """x [B, C, L] -> k3x.fused::DepthwiseConv1d (the kernel; no body) or ONNX's Conv (what the body runs)."""
    ins = [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in ("x", "w", "b")]
    node = helper.make_node("Conv", ["x", "w", "b"], ["y"], group=C) if body else \
        helper.make_node("DepthwiseConv1d", ["x", "w", "b"], ["y"], domain="k3x.fused", group=C)
    graph = helper.make_graph([node], "conv", ins, [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20), helper.make_opsetid("k3x.fused", 1)],
                             ir_version=10)


@pytest.mark.parametrize("B,C,L,W", [
    (1, 3072, 4, 4),  # a k3-bench decode step: one output a channel
    (2, 192, 4, 4),  # two sequences
    (6, 3000, 4, 4),  # over the threads, tasks across sequences
    (1, 192, 131, 4),  # a prefill chunk, over the threads
    (1, 64, 5, 5), (3, 40, 2, 2), (1, 33, 9, 1),  # other kernels
])
def test_depthwise_conv_kernel_equals_onnx_runtimes_conv_bit_for_bit(kernels, B, C, L, W):
    g = torch.Generator().manual_seed(B * C + L + W)
    feeds = {"x": torch.randn(B, C, L, generator=g).numpy(), "w": torch.randn(C, 1, W, generator=g).numpy(),
             "b": torch.randn(C, generator=g).numpy()}
    (y,) = session(_conv_model(C, W, body=False), kernels).run(None, feeds)
    (want,) = session(_conv_model(C, W, body=True)).run(None, feeds)
    assert y.shape == (B, C, L - W + 1)
    np.testing.assert_array_equal(y, want)


def test_depthwise_conv_kernel_names_the_bad_input(kernels):
    feeds = {"x": np.zeros((1, 8, 4), np.float32), "w": np.zeros((8, 1, 5), np.float32),
             "b": np.zeros(8, np.float32)}
    with pytest.raises(Exception, match=r"k3x.fused::DepthwiseConv1d: x \[1, 8, 4\], w \[8, 1, 5\] and b \[8\]: "
                                        r"expected \[B, C, L\], \[C, 1, W\] and \[C\], W <= L"):
        session(_conv_model(8, 5, body=False), kernels).run(None, feeds)
