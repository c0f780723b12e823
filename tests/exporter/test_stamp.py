"""exporter/stamp.py: the stamped trace (each distinct layer traced once) gives the per-layer trace's program.

- k3-mini with weights, growing and static latent cache: the same nodes in the same order (targets, arguments,
  node values' shapes), the same graph signature (parameter names, inputs, outputs), state_dict and range
  constraints, and the same outputs for a prefill and a decode step; the stamped `.pt2` loads and runs.
- Without AttnRes (Kimi Linear's pre-norm residual) the same holds for the graph.
- A module the stamped trace does not know falls back to the per-layer trace, and says why (the manifest's
  `trace` entry, written by the export pipeline: test_export_cli.py's folder records it too).
- exporter/stamp_save.py: the fast save of a stamped program is torch.export.save's archive record for record
  (every copied node also checked against torch's serialisation of it), loads with torch.export.load to the
  same graph and outputs, and falls back to torch.export.save, saying why, when a check fails; the manifest
  records which save wrote the pt2.
"""

from __future__ import annotations

import dataclasses
import io
import json
import zipfile

import pytest
import torch

from k3x.exporter import stamp_save
from k3x.exporter.stamp import layer_key, trace_recorded, trace_stamped
from k3x.exporter.stamp_save import StampSaveError, program_json, save_fast, save_recorded
from k3x.exporter.trace import load_pt2, save_pt2, trace
from k3x.model import K3ForCausalLM, build_model, empty_state, preset
from k3x.model.options import CacheOptions


def structure(ep) -> list[tuple]:
    """Every node as (op, target, arguments by position, value, tensor metadata's requires_grad) — names aside.
    (Symbolic strides may be written differently, e.g. `4*s70*(s60 + s70)` for `4*s60*s70 + 4*s70**2`.)"""
    index = {n: k for k, n in enumerate(ep.graph.nodes)}

    def arg(x):
        return torch.fx.node.map_arg(x, lambda n: ("node", index[n]))

    return [(n.op, str(n.target), arg(n.args), arg(n.kwargs), str(n.meta.get("val")),
             getattr(n.meta.get("tensor_meta"), "requires_grad", None)) for n in ep.graph.nodes]


def assert_same_program(a, b) -> None:
    assert structure(a) == structure(b)
    assert a.graph_signature.input_specs == b.graph_signature.input_specs
    assert a.graph_signature.output_specs == b.graph_signature.output_specs
    assert list(a.state_dict) == list(b.state_dict)
    assert a.range_constraints == b.range_constraints
    assert [(e.fqn, e.signature) for e in a.module_call_graph] == [(e.fqn, e.signature) for e in b.module_call_graph]


@pytest.fixture(scope="module")
def mini():
    model = build_model(preset("k3-mini"), seed=0)
    stamped, how = trace_recorded(model)
    assert how == {"mode": "stamped", "fallback": None}
    return model, stamped, trace(model)


def test_k3_mini_layers_share_four_templates(mini):
    model, _, _ = mini
    # KDA+dense (layer 0, no bank yet), KDA+MoE, MLA+MoE, KDA+MoE starting an AttnRes block (layer 4)
    assert len({layer_key(model, i) for i in range(model.cfg.num_layers)}) == 4


def test_stamped_program_is_the_per_layer_program(mini):
    _, stamped, per_layer = mini
    assert_same_program(stamped, per_layer)
    assert not any("k3x_stamp" in str(n.target) for n in stamped.graph.nodes)


def records(f) -> list[tuple[str, bytes]]:
    with zipfile.ZipFile(f) as z:
        return [(i.filename, z.read(i)) for i in z.infolist()]


def loaded_nodes(ep) -> list[tuple]:
    """Every node of a loaded program with its names, arguments, value and the metadata a .pt2 keeps."""
    return [(n.name, n.op, str(n.target), str(n.args), str(n.kwargs), str(n.meta.get("val")),
             n.meta.get("stack_trace"), n.meta.get("nn_module_stack")) for n in ep.graph.nodes]


def test_fast_save_writes_torchs_archive(mini):
    _, stamped, _ = mini
    ours, theirs = io.BytesIO(), io.BytesIO()
    counts = save_fast(stamped, ours, check_every=0)
    torch.export.save(stamped, theirs)
    assert records(ours) == records(theirs)  # every record (graph, weights, configs, inputs), byte for byte
    assert counts["nodes"] == len(stamped.graph.nodes) and counts["copied"] > 5 * counts["serialised"]
    model_json = dict(records(theirs))["archive/models/model.json"]
    assert program_json(stamped, check_every=1)[0] == model_json  # each copied node checked against torch's


def test_stamped_outputs_equal_per_layer_and_pt2_round_trips(mini, tmp_path):
    model, stamped, per_layer = mini
    cfg = model.cfg
    prefill = torch.randint(0, cfg.vocab_size, (2, 5))
    decode = torch.randint(0, cfg.vocab_size, (2, 1))
    save_pt2(stamped, tmp_path / "model.pt2")
    how = save_recorded(lambda save: save_pt2(stamped, tmp_path / "fast.pt2", save=save), stamped=True)[1]
    assert how == {"mode": "fast", "fallback": None}
    loaded, fast = load_pt2(tmp_path / "model.pt2"), load_pt2(tmp_path / "fast.pt2")
    assert loaded_nodes(fast) == loaded_nodes(loaded)
    runs = []
    for program in (per_layer.module(), stamped.module(), loaded.module(), fast.module()):
        with torch.no_grad():
            logits, present = program(prefill, empty_state(cfg, 2))
            logits2, present2 = program(decode, present)
        runs.append([logits, logits2, *present2])
    for other in runs[1:]:
        for x, y in zip(runs[0], other, strict=True):
            torch.testing.assert_close(x, y, rtol=0, atol=0)


def test_fast_save_falls_back_to_torch_when_a_check_fails(mini, tmp_path, monkeypatch):
    _, stamped, _ = mini
    render = stamp_save._Template.render  # a fault put in: copies that name the wrong values
    monkeypatch.setattr(stamp_save._Template, "render", lambda self, names, meta: render(self, names[::-1], meta))
    with pytest.raises(StampSaveError, match="copied serialisation is not torch's"):
        save_fast(stamped, io.BytesIO(), check_every=1)
    # the default check catches it too
    how = save_recorded(lambda save: save_pt2(stamped, tmp_path / "model.pt2", save=save), stamped=True)[1]
    assert how["mode"] == "torch" and "copied serialisation is not torch's" in how["fallback"]
    theirs = io.BytesIO()
    torch.export.save(stamped, theirs)
    assert records(tmp_path / "model.pt2") == records(theirs)


def test_static_cache_stamped_equals_per_layer():
    model = build_model(preset("k3-mini"), device="meta", seed=None)
    cache = CacheOptions(max_context=32)
    assert_same_program(trace_stamped(model, cache=cache), trace(model, cache=cache))


def test_without_attn_res_stamped_equals_per_layer():
    cfg = dataclasses.replace(preset("k3-mini"), attn_res=None)
    model = build_model(cfg, device="meta", seed=None)
    assert_same_program(trace_stamped(model), trace(model))


def test_unknown_module_falls_back_to_per_layer_and_says_why():
    class Wrapped(K3ForCausalLM):
        pass

    model = Wrapped(preset("k3-mini")).to("meta")
    ep, how = trace_recorded(model)
    assert how["mode"] == "per-layer" and "Wrapped is not a K3ForCausalLM" in how["fallback"]
    assert ep.graph_signature.input_specs  # a program all the same


def test_bad_trace_mode_is_refused():
    with pytest.raises(ValueError, match="trace mode='both'"):
        trace_recorded(build_model(preset("k3-mini"), device="meta", seed=None), mode="both")


@pytest.mark.parametrize("flags, mode, save", [([], "stamped", "fast"),
                                               (["--trace-mode", "per-layer"], "per-layer", "torch")])
def test_manifest_records_the_trace_and_save_used(tmp_path, flags, mode, save):
    from typer.testing import CliRunner

    from k3x.cli import app

    r = CliRunner().invoke(app, ["export", "--preset", "k3-mini", "--no-weights", "--target", "pt2",
                                 "--out", str(tmp_path / "out"), *flags])
    assert r.exit_code == 0, r.output
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["trace"] == {"mode": mode, "fallback": None}
    assert manifest["artifacts"]["pt2"]["save"] == {"mode": save, "fallback": None}


def test_unknown_trace_mode_flag_is_one_line(tmp_path):
    from typer.testing import CliRunner

    from k3x.cli import app

    r = CliRunner().invoke(app, ["export", "--preset", "k3-mini", "--no-weights", "--target", "pt2",
                                 "--out", str(tmp_path / "out"), "--trace-mode", "both"])
    assert r.exit_code != 0 and "--trace-mode" in r.output and "Traceback" not in r.output
    assert not (tmp_path / "out").exists()
