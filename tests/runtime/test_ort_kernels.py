"""The k3 ops' ONNX Runtime CPU kernels (runtime/ort_kernels.py): built from source (g++, ONNX Runtime's
headers from Debian's package) into this module's own cache, each kernel checked against its family's
reference in a model that has no function body beside the node (so the kernel, not a body, ran), and a
serving step with the library loaded equal to the same step on the function bodies."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from onnx import TensorProto, helper

from k3x.custom_ops.attn_res.reference import attn_res


@pytest.fixture(scope="module")
def kernels(tmp_path_factory):
    """The library, built into a fresh cache (the rest of the suite never sees it)."""
    mp = pytest.MonkeyPatch()
    mp.setenv("XDG_CACHE_HOME", str(tmp_path_factory.mktemp("cache")))
    mp.delenv("K3X_ORT_KERNELS", raising=False)
    from k3x.runtime.ort_kernels import build, library
    from k3x.runtime.runners import RunnerError

    assert library() is None  # nothing built in a fresh cache
    try:
        path = build()
    except RunnerError as e:  # the headers' mirror out of reach is the network's fault, not the code's
        if "cannot fetch" not in str(e):
            raise
        mp.undo()
        pytest.skip(str(e))
    assert library() == path
    yield path
    mp.undo()


def _session(model, library=None):
    import onnxruntime as ort

    so = ort.SessionOptions()
    if library is not None:
        so.register_custom_ops_library(str(library))
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def _attn_res_model(eps: float):
    """One k3::AttnRes node and no function: only a registered kernel can run it."""
    names = ("prefix", "bank", "norm_weight", "proj_weight")
    node = helper.make_node("AttnRes", list(names), ["out"], domain="k3", eps=eps, hidden_size=0)
    graph = helper.make_graph([node], "attn_res", [helper.make_tensor_value_info(n, TensorProto.FLOAT, None)
                                                   for n in names],
                              [helper.make_tensor_value_info("out", TensorProto.FLOAT, None)])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20), helper.make_opsetid("k3", 1)],
                             ir_version=10)


def test_without_the_library_the_bare_node_does_not_load():
    with pytest.raises(Exception, match="AttnRes"):
        _session(_attn_res_model(1e-5))


@pytest.mark.parametrize("rows,n,d,scale", [((1,), 1, 1, 1.0), ((5,), 3, 7, 1.0), ((2, 3), 8, 64, 1.0),
                                            ((37,), 2, 1030, 1.0), ((4,), 5, 96, 40.0)])
def test_attn_res_kernel_matches_the_reference(kernels, rows, n, d, scale):
    g = torch.Generator().manual_seed(sum(rows) * 131 + n * 7 + d)
    prefix = torch.randn(*rows, d, generator=g) * scale
    bank = torch.randn(*rows, n, d, generator=g) * scale
    norm, proj = 1 + 0.1 * torch.randn(d, generator=g), torch.randn(d, generator=g) / d ** 0.5
    out = _session(_attn_res_model(1e-5), kernels).run(None, {"prefix": prefix.numpy(), "bank": bank.numpy(),
                                                               "norm_weight": norm.numpy(), "proj_weight": proj.numpy()})[0]
    want = attn_res(prefix.double(), bank.double(), norm.double(), proj.double(), 1e-5)
    assert out.shape == tuple(prefix.shape)
    np.testing.assert_allclose(out, want.numpy(), rtol=1e-5, atol=1e-5 * scale)


def test_attn_res_kernel_names_a_bank_that_does_not_match(kernels):
    feeds = {"prefix": np.zeros((3, 8), np.float32), "bank": np.zeros((3, 2, 9), np.float32),
             "norm_weight": np.ones(8, np.float32), "proj_weight": np.ones(8, np.float32)}
    with pytest.raises(Exception, match=r"k3::AttnRes: bank \[3, 2, 9\] does not match prefix \[3, 8\]"):
        _session(_attn_res_model(1e-5), kernels).run(None, feeds)


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
    assert "AttnRes" not in ran[0] and "AttnRes" in ran[1]  # bodies inlined, then the kernel ran the nodes
    for name, want in outs[0].items():
        torch.testing.assert_close(torch.as_tensor(outs[1][name]), torch.as_tensor(want), rtol=1e-5, atol=1e-5,
                                   msg=lambda m, name=name: f"{name}: {m}")


def test_the_command_reports_the_library_and_names_a_missing_compiler(kernels, monkeypatch):
    from typer.testing import CliRunner

    from k3x.cli import app

    r = CliRunner().invoke(app, ["build-ort-kernels"])
    assert r.exit_code == 0 and f"{kernels}: kernels for k3::attn_res" in r.output, r.output
    monkeypatch.setenv("CXX", "no-such-compiler")
    r = CliRunner().invoke(app, ["build-ort-kernels"])
    assert r.exit_code == 1 and "'no-such-compiler' is not on PATH" in r.output, r.output
