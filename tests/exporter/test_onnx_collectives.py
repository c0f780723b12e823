"""Collectives in ONNX (exporter/onnx_collectives.py, runtime/ort_collectives.py, plugins/collectives.py) on a
tiny program with one all-reduce and one all-gather: the nodes each flavor gets, and the ort flavor run by
ONNX Runtime in two gloo processes (sum and rank-major concatenation, computed by torch.distributed from
inside the session). The k3-mini rank programs are covered in test_ranks_dist.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import pytest
import torch
import torch.distributed._functional_collectives as funcol

import k3x
from k3x.exporter.onnx import translation_table
from k3x.exporter.onnx_collectives import DIST_DOMAIN, PYOP_DOMAIN, counts
from k3x.exporter.onnx_flavors import FLAVOR_PASSES

GROUP = "k3x_tp"


class Tiny(torch.nn.Module):
    def forward(self, x):
        s = funcol.all_reduce(x * 2.0, "sum", GROUP)
        g = torch.ops._c10d_functional.all_gather_into_tensor(s.t().contiguous(), 2, GROUP)
        return s, funcol.wait_tensor(g).t() + 1.0


def _export(out: Path) -> dict[str, Path]:
    ep = torch.export.export(Tiny(), (torch.ones(3, 4),))
    files = {}
    for flavor in ("trt", "ort"):  # the order export_onnx uses: one model through both passes
        model = torch.onnx.export(ep, dynamo=True, custom_translation_table=translation_table(), optimize=False,
                                  opset_version=23, verbose=False).model
        model.ir_version = 10  # onnxruntime-gpu 1.31 reads IR <= 13
        FLAVOR_PASSES[flavor](model)
        files[flavor] = out / f"{flavor}.onnx"
        ir.save(model, files[flavor])
    return files


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict[str, Path]:
    return _export(tmp_path_factory.mktemp("tiny"))


def _nodes(path: Path) -> list[onnx.NodeProto]:
    return [n for n in onnx.load(path).graph.node if n.domain]


def test_flavors_carry_the_collectives_as_nodes(tiny):
    trt = _nodes(tiny["trt"])
    assert [(n.domain, n.op_type) for n in trt] == [(DIST_DOMAIN, "AllReduce"), (DIST_DOMAIN, "AllGather")]
    attrs = [{a.name: onnx.helper.get_attribute_value(a) for a in n.attribute} for n in trt]
    assert attrs == [{"reduce_op": b"sum", "group_name": b"k3x_tp", "plugin_namespace": b"k3"},
                     {"group_size": 2, "group_name": b"k3x_tp", "plugin_namespace": b"k3"}]
    ort = _nodes(tiny["ort"])
    assert [(n.domain, n.op_type) for n in ort] == [(PYOP_DOMAIN, "AllReduce"), (PYOP_DOMAIN, "AllGather")]
    assert all("plugin_namespace" not in {a.name for a in n.attribute} for n in ort)
    assert counts(ir.load(tiny["ort"])) == {"AllGather": 1, "AllReduce": 1}
    for flavor, domain in (("trt", DIST_DOMAIN), ("ort", PYOP_DOMAIN)):
        imports = {o.domain for o in onnx.load(tiny[flavor]).opset_import}
        assert domain in imports and ({DIST_DOMAIN, PYOP_DOMAIN} - {domain}).isdisjoint(imports)
    assert not any(n.op_type == "wait_tensor" for n in onnx.load(tiny["ort"]).graph.node)


RANK_SCRIPT = """
import os, sys
import numpy as np, torch, torch.distributed as dist
from k3x.runtime.ort_runner import ort_session
dist.init_process_group("gloo")
torch._C._distributed_c10d._register_process_group("k3x_tp", dist.group.WORLD)
rank = dist.get_rank()
sess, _ = ort_session(sys.argv[1], "cpu", collectives=True)
x = np.arange(12, dtype=np.float32).reshape(3, 4) * (rank + 1)
s, g = sess.run(None, {sess.get_inputs()[0].name: x})
np.save(os.path.join(sys.argv[2], f"rank{rank}.npy"), np.concatenate([s.ravel(), g.ravel()]))
dist.destroy_process_group()
"""


def test_ort_flavor_runs_the_collectives_on_torch_distributed(tiny, tmp_path):
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    root = str(Path(k3x.__file__).parent.parent)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                        str(script), str(tiny["ort"]), str(tmp_path)], env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    s = 2 * x * 1 + 2 * x * 2  # all-reduce of 2x over ranks (x scaled by rank + 1)
    g = np.concatenate([s, s], axis=1) + 1  # gather of s^T on axis 0 -> both ranks' s side by side
    want = np.concatenate([s.ravel(), g.ravel()])
    for rank in (0, 1):
        np.testing.assert_array_equal(np.load(tmp_path / f"rank{rank}.npy"), want)


def test_ort_session_without_a_process_group_is_refused_before_it_runs(tiny):
    """An exception inside a Python op would abort the process: the runner refuses first, in one line."""
    from k3x.runtime.ort_runner import ort_session
    from k3x.runtime.runners import RunnerError

    with pytest.raises(RunnerError, match=r"groups \['k3x_tp'\]\) need torch.distributed"):
        ort_session(tiny["ort"], "cpu", collectives=True)


def test_collective_plugin_fields_and_shapes():
    from k3x.plugins.collectives import check_attrs, output_shape
    from k3x.plugins.core import PluginError

    assert check_attrs("AllGather", {"group_size": 4, "group_name": "k3x_tp"}) == {"group_size": 4,
                                                                                 "group_name": "k3x_tp"}
    assert output_shape("AllGather", [3, 5], {"group_size": 4}) == [12, 5]
    assert output_shape("AllReduce", [3, 5], {"reduce_op": "sum"}) == [3, 5]
    with pytest.raises(PluginError, match="field 'group_name' is missing"):
        check_attrs("AllReduce", {"reduce_op": "sum"})
    with pytest.raises(PluginError, match="reduce_op='max'"):
        check_attrs("AllReduce", {"reduce_op": "max", "group_name": "g"})
