"""Rank programs on torch.distributed (gloo, CPU): k3-mini (4 heads, MXFP4 experts kept packed) at TP=2, EP=2 and
TP=2 x EP=2 against the single-process eager model — logits and every state over a prefill and 8 decode steps
within the tolerance table, greedy tokens identical (`k3x verify` on a sharded export); the TP x EP export also
carries each rank's ONNX (collectives as nodes), verified through ONNX Runtime in the same 4 processes, and
its trt flavor builds with TensorRT-RTX.

One export per layout (module scope; the TP=2 one serves the parity and the `k3x run` tests). Every launch is
a subprocess (tests/dist_launch.py) with a timeout and a bounded gloo timeout, so a broken launcher fails the
test instead of hanging it. Cost on the 2-core machine: dominated by torch.export.load of each rank's
program (~6 CPU-s each), one trace (+ one ONNX conversion) per layout, and the 4-process verify.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import onnx
import pytest
import torch
from dist_launch import LAUNCH_TIMEOUT_S, env, launch
from typer.testing import CliRunner

import k3x
from k3x.checkpoint.save import save_checkpoint
from k3x.cli import app
from k3x.exporter.onnx_functions import model_nodes
from k3x.folder.artifacts import ExportFolder, read_manifest
from k3x.model import build_model, preset

@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("ck") / "k3-mini"  # k3-mini splits at TP=2 x EP=2 as it is
    save_checkpoint(build_model(preset("k3-mini"), seed=1), path, expert_format="mxfp4")
    return path


def _export(checkpoint: Path, out: Path, tp: int, ep: int, *targets: str) -> Path:
    r = CliRunner().invoke(app, ["export", "--checkpoint", str(checkpoint), "--tp", str(tp), "--ep", str(ep),
                                 "--out", str(out), *[a for t in targets for a in ("--target", t)]])
    assert r.exit_code == 0, r.output
    return out


@pytest.fixture(scope="module")
def export_of(checkpoint, tmp_path_factory):
    """(tp, ep) -> a pt2 rank export, made once per module (the TP=2 one serves two tests)."""
    made: dict[tuple[int, int], Path] = {}

    def get(tp: int, ep: int) -> Path:
        if (tp, ep) not in made:
            made[tp, ep] = _export(checkpoint, tmp_path_factory.mktemp("x") / f"tp{tp}ep{ep}", tp, ep)
        return made[tp, ep]

    return get


@pytest.fixture(scope="module")
def tp2ep2(checkpoint, tmp_path_factory) -> Path:
    return _export(checkpoint, tmp_path_factory.mktemp("x") / "tp2ep2", 2, 2, "pt2", "onnx")


def _verify(export: Path, tmp: Path, torchrun: int | None, backends: tuple[str, ...] = ("pt2",)) -> dict:
    report = tmp / "verify.json"
    r = launch(["verify", str(export), "--steps", "8", "--json", str(report)], torchrun=torchrun)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    assert "PASS" in r.stdout and "greedy tokens (9): identical" in r.stdout, r.stdout[-2000:]
    assert "state contract: ok" in r.stdout, r.stdout[-2000:]  # every rank's state share, every backend
    data = json.loads(report.read_text())
    assert data["ok"] and data["greedy_identical"] and len(data["steps"]) == 9 * len(backends)
    assert data["state_ok"] and data["state_findings"] == []
    outputs = data["steps"][-1]["outputs"]
    assert "logits" in outputs and sum(k.startswith("present.") for k in outputs) == 9  # every state compared
    assert data["backends"] == list(backends)  # verify checks every backend the rank folders hold
    assert {s["backend"].split()[0] for s in data["steps"]} == set(backends), data["steps"][0]
    return data


def test_sharded_export_layout_and_manifest(tp2ep2):
    m = read_manifest(tp2ep2)
    par = m["parallel"]
    assert (par["tp"], par["ep"], par["world"]) == (2, 2, 4) and len(par["ranks"]) == 4
    assert [r["experts"] for r in par["ranks"]] == [[0, 4], [0, 4], [4, 8], [4, 8]]
    assert m["op_counts"] == {"k3::attn_res": 12, "k3::kda": 3, "k3::moe_mxfp4": 5,  # experts stay packed
                              "_c10d_functional::all_gather_into_tensor": 1,  # vocab-parallel head
                              "_c10d_functional::all_reduce": 18}  # embed + 6 mixers + dense + 5 x (EP + shared)
    hashes = set()
    for r in par["ranks"]:
        folder = ExportFolder.open(tp2ep2 / r["dir"])
        assert folder.verify() == [] and folder.config().kda.num_heads == 2 and folder.config().vocab_size == 256
        listed = {f["path"]: f["sha256"] for f in r["files"]}  # every artifact file of the rank, with its hash
        own = {f"{r['dir']}/{f['path']}": f["sha256"] for a in folder.manifest["artifacts"].values() for f in a["files"]}
        assert listed == own and sorted(p.split("/")[1] for p in listed) == ["model.onnx", "model.pt2", "model.trt.onnx"]
        hashes.add(tuple(sorted(listed.values())))
        assert folder.manifest["artifacts"]["onnx"]["collectives"] == {"AllGather": 1, "AllReduce": 18}
    assert len({h for t in hashes for h in t}) == 12  # the weights differ ...
    graphs = {zipfile.ZipFile(tp2ep2 / r["dir"] / "model.pt2").read("archive/models/model.json") for r in par["ranks"]}
    assert len(graphs) == 1  # ... the serialised program does not: one trace serves every rank
    for flavor in ("model.onnx", "model.trt.onnx"):  # nor does the ONNX graph
        nodes = set()
        for r in par["ranks"]:
            model = onnx.load(tp2ep2 / r["dir"] / flavor)  # main graph and layer functions alike
            nodes.add(tuple(n.SerializeToString() for n in model_nodes(model)))
        assert len(nodes) == 1


@pytest.mark.parametrize("bad", ["../elsewhere", "rank-000/../../x", 7])
def test_rank_folders_confined_to_the_export(tp2ep2, tmp_path, bad):
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(tp2ep2, copy)
    m = json.loads((copy / "manifest.json").read_text())
    m["parallel"]["ranks"][1]["dir"] = bad
    (copy / "manifest.json").write_text(json.dumps(m))
    r = CliRunner().invoke(app, ["run", str(copy), "--prompt-ids", "1"])
    assert r.exit_code == 1 and ("parallel" in r.output or "refused" in r.output), r.output
    assert "Traceback" not in r.output


def test_backend_the_rank_folders_lack_is_one_line(tp2ep2):
    r = CliRunner().invoke(app, ["verify", str(tp2ep2), "--backends", "pt2,trt"])
    assert r.exit_code == 1 and "sharded export has rank programs for ['pt2', 'ort'], not ['trt']" in r.output
    assert "Traceback" not in r.output


def test_bad_plan_fails_before_anything_is_written(checkpoint, tmp_path):
    r = CliRunner().invoke(app, ["export", "--checkpoint", str(checkpoint), "--tp", "3", "--out", str(tmp_path / "o")])
    assert r.exit_code == 1 and "kda.num_heads=4: not divisible by tp=3" in r.output
    assert not (tmp_path / "o").exists()


def test_parity_tp2_x_ep2_four_processes_spawned_without_a_launcher(tp2ep2, tmp_path):
    """`k3x verify DIR` outside torchrun starts the 4 ranks through torch.distributed.run itself."""
    data = _verify(tp2ep2, tmp_path, torchrun=None, backends=("pt2", "ort"))
    assert data["plan"] == {"tp": 2, "ep": 2, "world": 4, "rank_order": "rank = ep_rank * tp + tp_rank"}


@pytest.mark.slow
@pytest.mark.parametrize("tp,ep", [(2, 1), (1, 2)])
def test_parity_under_torchrun(export_of, tmp_path, tp, ep):
    _verify(export_of(tp, ep), tmp_path, torchrun=tp * ep)


WORKER = Path(__file__).parent.parent / "rank_verify_worker.py"
DECODED = "logits: decoded from {} in layers 0, 1, 3, not from the state it was given"  # k3-mini's KDA layers


@pytest.mark.parametrize("bug,rank,step,source", [
    ("zeroed", 1, 1, "a zeroed KDA state"),
    pytest.param("stale", 0, 2, "the KDA state of one step earlier (stale)", marks=pytest.mark.slow),
    pytest.param("transposed", 1, 1, "a transposed KDA recurrent state (key and value axes swapped)",
                 marks=pytest.mark.slow)])
def test_verify_names_the_rank_whose_state_is_wrong(export_of, tmp_path, bug, rank, step, source):
    """`k3x verify` at TP=2 with one state bug in ONE rank's program (tests/state_bugs.py): the state checks hand
    every rank its share of the true state and name that rank, the bug and its layers; exit 1. The honest
    rank, whose logits and later layers only follow from the other's bug, is not blamed from then on."""
    report = tmp_path / "verify.json"
    r = launch([bug, str(rank), str(export_of(2, 1)), "--steps", "1", "--json", str(report)], torchrun=2,
               script=WORKER)
    assert r.returncode == 1, (r.stdout + r.stderr)[-4000:]
    assert "state contract: FAIL" in r.stdout and "Traceback" not in r.stdout, r.stdout[-3000:]
    assert f"  pt2 rank {rank} decode {step}: {DECODED.format(source)}" in r.stdout, r.stdout[-3000:]
    findings = json.loads(report.read_text())["state_findings"]
    assert {f["backend"] for f in findings if f["step"] >= step} == {f"pt2 rank {rank}"}, findings
    assert all(f["problem"].startswith("decoded from") for f in findings if f["step"] >= step), findings


@pytest.mark.slow
def test_run_under_torchrun_matches_eager_greedy(export_of, checkpoint):
    """`k3x run` under torchrun on the TP=2 pt2 export: the default --backend ort finds no ONNX there and says it
    runs the pt2 rank programs (the ORT rank programs are run by the TP x EP verify); rank 0 prints, tokens =
    the eager model's."""
    from k3x.checkpoint.files import load_checkpoint
    from k3x.runtime.generate import generate
    from k3x.text.sampling import SamplingOptions

    r = launch(["run", str(export_of(2, 1)), "--prompt-ids", "5,6,7", "--max-new-tokens", "6"], torchrun=2)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    assert "tp=2 ep=1, pt2" in r.stdout, r.stdout[-2000:]
    assert r.stdout.count("this sharded export has no ONNX; running the pt2 rank programs") == 1  # rank 0 says it
    tokens = [line for line in r.stdout.splitlines() if line.startswith("tokens: ")]
    assert len(tokens) == 1, r.stdout  # rank 0 prints, the others do not
    want = generate(load_checkpoint(checkpoint), torch.tensor([[5, 6, 7]]), SamplingOptions(6)).tokens
    assert tokens[0] == "tokens: " + ",".join(str(t) for t in want[0].tolist())
    assert "peak RSS per rank (MiB): 0:" in r.stdout


@pytest.mark.trt
@pytest.mark.skipif(importlib.util.find_spec("tensorrt_rtx_bindings") is None,
                    reason="TensorRT-RTX not installed (pip install -e .[trt-rtx]; scripts/setup_trt_rtx.sh)")
def test_rank_trt_onnx_builds_with_collective_plugins(tp2ep2, tmp_path):
    """TensorRT-RTX on CPU parses rank 1's trt ONNX, resolves its AllReduce / AllGather nodes to the k3
    collective plugins (fields, shape and type functions, formats) and builds the engine. Not run: enqueue
    (NCCL needs GPUs)."""
    import shutil

    rank = tmp_path / "rank-001"
    shutil.copytree(tp2ep2 / "rank-001", rank)
    root = Path(k3x.__file__).parent
    link = subprocess.run([str(root / "scripts/setup_trt_rtx.sh"), "--print-only", sys.prefix], check=True,
                          capture_output=True, text=True).stdout.strip()
    rtx_env = env() | {"LD_LIBRARY_PATH": f"{link}:{os.environ.get('LD_LIBRARY_PATH', '')}"}
    r = subprocess.run([sys.executable, "-m", "k3x", "build-engine", str(rank), "--runtime", "trt-rtx", "--sm", "89"],
                       env=rtx_env, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    blob = (rank / "model.engine").read_bytes()
    for needle in (b"AllReduce", b"AllGather", b"k3x_tp", b"k3x_ep", b"group_size"):
        assert needle in blob, needle  # the plugin layers and their serialised fields


def test_spawned_ranks_get_omp_threads_and_their_spawner_so_no_torchrun_banner(monkeypatch):
    import torch.distributed.run as launcher

    from k3x.runtime import dist_run

    seen = {}
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(launcher, "run", lambda args: seen.update(omp=os.environ.get("OMP_NUM_THREADS"),
                                                                 spawner=os.environ.get(dist_run.SPAWNED_BY)))
    dist_run.spawn(2, ["run", "x"])
    assert seen["omp"] == str(dist_run.omp_threads(2)) and int(seen["omp"]) >= 1
    # the ranks learn who started them (follow_spawner); this process's environment keeps it only while they run
    assert seen["spawner"] == str(os.getpid()) and dist_run.SPAWNED_BY not in os.environ
