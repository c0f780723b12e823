"""One export pipeline for any rank count (exporter/pipeline.export reads the plan) and one runner factory
(runtime/session.open_session reads the manifest's `parallel` entry): the same calls at 1 rank and at
TP=2 x EP=2 on the default k3-mini (the multi-rank run itself: tests/runtime/test_ranks_dist.py)."""

from __future__ import annotations

import json

import pytest
import torch

from k3x.exporter.options import ExportOptions, Target

from k3x.exporter.pipeline import export
from k3x.model import preset
from k3x.model.config import ConfigError
from k3x.runtime import session as sessions


@pytest.mark.parametrize("tp,ep", [(1, 1), (2, 2)])
def test_one_export_call_for_any_rank_count(tmp_path, tp, ep):
    out = tmp_path / "ex"
    result = export(ExportOptions((Target.PT2,), out, preset="k3-mini", tp=tp, ep=ep))
    m = json.loads((out / "manifest.json").read_text())
    assert m["config_hash"] == preset("k3-mini").hash() and "kernels" not in m["config"]
    assert m["options"] == {"kernels": "reference", "expert_format": "dense", "activations": "bf16",
                            "trunk": "dense", "max_context": None}
    assert sessions.parallel_plan(out).world == tp * ep
    if tp * ep == 1:
        assert "parallel" not in m and (out / "model.pt2").is_file() and "trace" in result.timings
        s = sessions.open_session(out, ["pt2"])
        ids = torch.tensor([[1, 2, 3]])
        sessions.check(s, batch=1, prompt_len=3, new_tokens=4, backends=["pt2"])
        from k3x.text.sampling import SamplingOptions

        assert sessions.decode(s, "pt2", ids, SamplingOptions(4)).tokens.shape == (1, 4)
        assert sessions.backends_of(out, []) == (["pt2"], [])
        return
    par = m["parallel"]
    assert (par["tp"], par["ep"], len(par["ranks"])) == (2, 2, 4)
    assert [r["experts"] for r in par["ranks"]] == [[0, 4], [0, 4], [4, 8], [4, 8]]
    for r in par["ranks"]:
        rank = json.loads((out / r["dir"] / "manifest.json").read_text())
        assert rank["options"] == m["options"] and rank["config"]["kda"]["num_heads"] == 2
    assert result.notes[-1].startswith("ranks: 4 rank folder(s) of 4 ranks (tp=2, ep=2)")
    assert sessions.backends_of(out, []) == (["pt2"], [])
    assert sessions.backends_of(out, ["ort"], default_ort=True)[0] == ["pt2"]


@pytest.mark.parametrize("kwargs,line", [
    ({"tp": 2, "max_context": 16}, "--max-context: the static latent cache is not available for rank programs"),
    ({"tp": 2, "targets": (Target.AOTI,)}, "--tp/--ep: rank programs are written for --target pt2 and onnx only"),
])
def test_rank_exports_refuse_what_they_cannot_write_in_one_line(tmp_path, kwargs, line):
    with pytest.raises(ConfigError, match=f"^{line}"):
        ExportOptions(**{"targets": (Target.PT2,), "out_dir": tmp_path / "x", "preset": "k3-mini", **kwargs})
    assert not (tmp_path / "x").exists()
