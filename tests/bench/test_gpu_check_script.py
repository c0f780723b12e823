"""bench/gpu_check.py on the GPU machine's stack: no onnx / onnxruntime / tensorrt on any section's import path
(run where those imports fail, as they do there), a report on disk after every section (a run killed in the
middle still returns what it measured), per-section time budgets, fla's autotuning cut to a few configs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench"

# makes `import onnx` (and friends) fail as on a machine without them; importlib.util.find_spec says "absent"
NO_ONNX = r'''
import importlib.abc, importlib.util, sys
BLOCKED = {"onnx", "onnxruntime", "onnxscript", "onnx_ir", "tensorrt", "tensorrt_rtx", "tensorrt_bindings"}
class _Absent(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {name!r} (blocked: the GPU machine has none)", name=name)
        return None
sys.meta_path.insert(0, _Absent())
_find_spec = importlib.util.find_spec
importlib.util.find_spec = lambda name, package=None: (
    None if name.split(".")[0] in BLOCKED else _find_spec(name, package))
for m in [m for m in sys.modules if m.split(".")[0] in BLOCKED]:
    del sys.modules[m]
sys.path.insert(0, "bench")
'''


def _child(code: str, env: dict | None = None, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", NO_ONNX + code], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})


def test_blocker_really_blocks():
    proc = _child("import onnx")
    assert proc.returncode != 0 and "blocked" in proc.stderr


def test_every_section_imports_without_onnx():
    proc = _child("import gpu_check, gpu_check_bench, gpu_check_plugins, gpu_check_w4a8, gpu_check_serving, "
                  "gpu_check_models\n"
                  "gpu_check._make_k3x_importable()\n"
                  "gpu_check_bench.imports(); specs = gpu_check_plugins.launch_specs()\n"
                  "import k3x.model, k3x.runtime.tolerances, k3x.plan.launch, k3x.bench.serving_steps\n"
                  "bad = sorted(m for m in sys.modules if m.split('.')[0] in BLOCKED)\n"
                  "assert not bad, bad\n"
                  "print(sorted(specs))\n")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "['AttnRes', 'KDA', 'MoE']" in proc.stdout


def test_cpu_selftest_without_onnx(tmp_path):
    """The parity sections and the model end-to-end section run (CPU interpreter) with onnx absent."""
    proc = _child("import runpy; sys.argv = ['gpu_check.py', '--cpu-selftest']\n"
                  "runpy.run_path('bench/gpu_check.py', run_name='__main__')\n",
                  env={"TRITON_INTERPRET": "1", "OUT": str(tmp_path)})
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    parity = [r for r in report["results"] if r["kind"] == "parity"]
    assert report["failed"] == 0 and report["selftest"] and report["complete"], out
    assert {r["name"].split()[0] for r in parity} >= {"kda_chunked", "kda_recurrent_", "attn_res", "moe", "moe_w4a8",
                                                       "moe_w4a16", "kda_packed", "kda_prep", "mla_paged", "tune"}, out
    serving = {" ".join(r["name"].split()[:2]) for r in parity if r["name"].startswith(("kda_packed", "mla_paged"))}
    assert serving >= {"kda_packed o", "kda_packed state", "mla_paged decode", "mla_paged rows"}, out
    assert all(r["ok"] for r in parity), out
    w4a8 = [r for r in parity if r["name"].startswith("moe_w4a8 ")]  # MXFP8 activations, decode and prefill tiles
    assert {r["name"].split()[2] for r in w4a8} == {"decode", "prefill"}, out
    assert all(r["metrics"]["rmse_ratio"] < 0.5 * r["metrics"]["rmse_ratio_vs_bf16_activations"] for r in w4a8), out


def test_only_runs_the_named_sections_in_that_order(tmp_path):
    """--only (a rerun of what failed): just those sections, in the order given; an unknown name is refused."""
    proc = _child("import runpy; sys.argv = ['gpu_check.py', '--cpu-selftest', '--only', "
                  "'parity_serving,parity_attn_res']\n"
                  "runpy.run_path('bench/gpu_check.py', run_name='__main__')\n",
                  env={"TRITON_INTERPRET": "1", "OUT": str(tmp_path)})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    sections = [r["name"][: -len(" time")] for r in report["results"] if r["name"].endswith(" time")]
    assert sections == ["parity_serving", "parity_attn_res"], sections
    bad = _child("import runpy; sys.argv = ['gpu_check.py', '--cpu-selftest', '--only', 'parity_kda,nope']\n"
                 "runpy.run_path('bench/gpu_check.py', run_name='__main__')\n", env={"TRITON_INTERPRET": "1"})
    assert bad.returncode == 2 and "no section named nope" in bad.stderr, bad.stderr


def test_every_section_has_a_budget_within_the_unchanged_total():
    """Each section of CHECKS has its own budget (none falls back to the default), the W4A8 ones run right after
    their bf16 counterparts, every correctness section runs before the benchmarks, and the run's total leaves room
    on the device machine (15 minutes a lease, 10 a command, a minute or two to start) for a rerun: < 9 min."""
    sys.path.insert(0, str(BENCH))
    import gpu_check as gc

    names = [fn.__name__ for fn in gc.CHECKS]
    assert set(names) == set(gc.BUDGETS_S), set(names) ^ set(gc.BUDGETS_S)
    assert names.index("parity_moe_w4a8") == names.index("parity_moe") + 1
    assert names.index("bench_moe_w4a8") == names.index("bench_moe") + 1
    late = ("kda_state_configs", "tune")
    assert max(names.index(n) for n in names if not n.startswith("bench_") and n not in late) < \
        names.index("bench_ceilings"), names
    assert names[-1] == "tune"  # spends a lease of its own (`--only tune`): a whole run reaches it out of budget
    assert gc.DEFAULT_BUDGET_S < 540 and gc.QUICK_BUDGET_S < 360


def test_plugin_port_tables_match_the_plugin_specs():
    sys.path.insert(0, str(BENCH))
    import gpu_check_plugins

    from k3x.custom_ops.trt_plugins import specs

    real = specs()
    for name, (_, ins, outs) in gpu_check_plugins.PORTS.items():
        assert tuple(p.name for p in real[name].inputs) == ins
        assert tuple(p.name for p in real[name].outputs) == outs


def test_report_written_after_every_section_survives_a_kill(tmp_path):
    """The second section is killed (SIGKILL, as a device time limit would): the first one's results are on disk."""
    path = tmp_path / "gpu_check.json"
    proc = _child(
        "import os, signal, gpu_check as gc\n"
        "def first(ctx): return [gc.Result('first', 'bench', None, {'ms': 1.5})]\n"
        "def second(ctx): os.kill(os.getpid(), signal.SIGKILL)\n"
        "gc.CHECKS[:] = [first, second]\n"
        "ctx = gc.Context('cpu', None, selftest=True, bench=True)\n"
        f"gc.run(ctx, gc.Path({str(path)!r}), {{'device': 'test'}})\n")
    assert proc.returncode != 0
    report = json.loads(path.read_text())
    assert report["running"] == "second" and not report["complete"]
    assert [r["name"] for r in report["results"]][:1] == ["first"] and report["results"][0]["metrics"] == {"ms": 1.5}


def test_sections_have_their_own_budget(tmp_path):
    sys.path.insert(0, str(BENCH))
    import gpu_check as gc

    seen = {}

    def parity_kda(ctx):  # a name with a budget in BUDGETS_S
        seen["left"] = ctx.time_left()
        return []

    def slow(ctx):
        ctx.deadline = 0.0  # pretend the section outran everything
        ctx.budget_s = 0.0
        return []

    def never(ctx):
        raise AssertionError("runs after the run's budget is spent")

    old = gc.CHECKS[:]
    try:
        gc.CHECKS[:] = [parity_kda, slow, never]
        ctx = gc.Context("cpu", None, selftest=True, bench=False, quick=True)
        results = gc.run(ctx, tmp_path / "r.json", {})
    finally:
        gc.CHECKS[:] = old
    assert 0 < seen["left"] <= gc.BUDGETS_S["parity_kda"] * gc.QUICK
    skipped = [r for r in results if r.name == "never"]
    assert skipped and "budget" in skipped[0].note
    assert json.loads((tmp_path / "r.json").read_text())["results"][-1]["name"] == "never"


def test_fla_autotune_limited():
    pytest.importorskip("fla.ops.kda")
    sys.path.insert(0, str(BENCH))
    from gpu_check_timing import limit_fla_autotune
    from triton.runtime.autotuner import Autotuner

    limit_fla_autotune(2)
    tuners = [o for n, m in list(sys.modules.items()) if n.startswith("fla.") and m is not None
              for o in vars(m).values() if isinstance(o, Autotuner)]
    assert tuners and max(len(t.configs) for t in tuners) <= 2


def test_decode_graph_section_uses_a_static_cache_on_a_hybrid_model():
    """The graph section's cases and decode loop, run on the CPU without onnx: the first case is hybrid with a
    static latent cache that holds the whole timed run, so every decode step has one shape (one key: the
    graphed runner captures once and replays); the growing case changes shape every step."""
    proc = _child(
        "import gpu_check, gpu_check_bench as gb\n"
        "gpu_check._make_k3x_importable()\n"
        "import torch\n"
        "from k3x.runtime import runners\n"
        "from k3x.runtime.cuda_graph import GraphedRunner\n"
        "from k3x.model import build_model, preset\n"
        "(st, static), (gt, growing) = gb.decode_graph_cases(preset('k3-mini'))\n"
        "assert 'mla' in preset('k3-mini').layer_types and 'kda' in preset('k3-mini').layer_types\n"
        "assert static.max_context == gb.PROMPT + gb.WARMUP + gb.STEPS and growing.max_context is None\n"
        "cfg = preset('k3-mini')\n"
        "runners.check_request(cfg, batch=1, prompt_len=gb.PROMPT, new_tokens=gb.WARMUP + gb.STEPS + 1, dims={},\n"
        "                      cache=static)\n"
        "model = build_model(cfg, seed=0)\n"
        "keys = {}\n"
        "for tag, cache in ((st, static), (gt, growing)):\n"
        "    class Keys(runners.ModuleRunner):\n"
        "        def infer(self, feeds):\n"
        "            keys.setdefault(tag, []).append(GraphedRunner.key(feeds))\n"
        "            return super().infer(feeds)\n"
        "    ms, toks = gb.decode_tokens(runners, Keys('eager', model, cfg, None, cache), cfg, torch.float32, 'cpu',\n"
        "                                cache)\n"
        "    assert ms > 0 and toks.shape == (1, gb.WARMUP + gb.STEPS), toks.shape\n"
        "    if tag == st: static_toks = toks\n"
        "    else: assert torch.equal(toks, static_toks)\n"
        "assert len(set(keys[st][1:])) == 1, 'static: one key for every decode step'\n"
        "assert len(set(keys[gt][1:])) == gb.WARMUP + gb.STEPS, 'growing: a new key every step'\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in BLOCKED)\n"
        "assert not bad, bad\n"
        "print('ok')\n")
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stdout + proc.stderr


def test_end_to_end_serving_pieces_run_on_cpu():
    """gpu_check_models' serving runs and decode-step timer on the CPU with the reference kernels: every variant
    (prefix cache, n-gram and model drafts) gives the plain run's tokens; the cache hits, the n-gram drafts are
    fed and rejected (a random model does not continue the pattern), the model's drafts accepted; and a step
    timed as the section times it (StepCase with an eager step runner) writes its rows back into the pools."""
    sys.path.insert(0, str(BENCH))
    import torch
    from gpu_check_models import VARIANTS, serving_runs

    from k3x.bench.serving_steps import StepCase
    from k3x.model import build_model, preset
    from k3x.model.serving import K3ServingStep
    from k3x.runtime.serve import StepModuleRunner

    runs = serving_runs("reference", "cpu")
    plain = runs["plain"]
    assert [len(r.tokens) for r in plain] == [4, 8, 3, 6, 5, 2, 5, 4, 9]
    assert all(len(r.logits) == len(r.tokens) for r in plain)
    for variant in VARIANTS[1:]:
        assert [r.tokens for r in runs[variant]] == [r.tokens for r in plain], variant
    assert sum(r.cached for r in runs["prefix cache"]) >= 64
    assert sum(r.counts.drafted for r in runs["ngram drafts"]) > 0
    assert sum(r.counts.accepted for r in runs["model drafts"]) > 0
    cfg = preset("k3-mini")
    step = K3ServingStep(build_model(cfg, seed=0).eval(), kernels="reference")
    case = StepCase(cfg, batch=3, positions=21, capacity=21, block_size=4)
    timer = case.timer(StepModuleRunner("eager", step, step.input_names, step.output_names), 1, 20)
    before = {n: t.clone() for n, t in case.pools.tensors.items()}
    assert timer() > 0
    changed = {n for n, t in case.pools.tensors.items() if not torch.equal(t, before[n])}
    assert changed == set(before), set(before) - changed


def test_a_section_that_loses_the_device_hands_the_rest_to_a_fresh_process(tmp_path):
    """After a section raises and the device no longer runs work (a CUDA fault poisons the context for good),
    the report on disk holds everything so far and the script re-executes itself for the remaining sections,
    within what is left of the budget; the fresh process puts the earlier results first."""
    code = (
        "import os, gpu_check as gc\n"
        "def first(ctx): return [gc.Result('first', 'parity', True)]\n"
        "def fault(ctx): raise RuntimeError('CUDA error: an illegal memory access was encountered')\n"
        "def parity_attn_res(ctx): raise AssertionError('runs in the poisoned process')\n"
        "gc.CHECKS[:] = [first, fault, parity_attn_res]\n"
        "gc.BUDGETS_S.update(first=5, fault=5)\n"
        "gc.device_alive = lambda ctx: False\n"
        "def execv(exe, args): print('EXEC', args[1:]); raise SystemExit(0)\n"
        "os.execv = execv\n"
        "gc.main(['--cpu-selftest', '--quick'])\n")
    proc = _child(code, env={"TRITON_INTERPRET": "1", "OUT": str(tmp_path)})
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "EXEC" in proc.stdout, out
    args = eval(proc.stdout.split("EXEC", 1)[1].strip())  # noqa: S307 - our own printed list
    report_path = str(tmp_path / "gpu_check.json")
    assert args[0].endswith("bench/gpu_check.py") and args[1:4] == ["--cpu-selftest", "--quick", "--only"], args
    assert args[4] == "parity_attn_res" and args[-2:] == ["--continue-from", report_path], args
    sys.path.insert(0, str(BENCH))
    import gpu_check

    assert 0 < float(args[args.index("--budget") + 1]) <= gpu_check.QUICK_BUDGET_S, args
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert [r["name"] for r in report["results"]] == ["first", "first time", "fault", "fault time"]
    assert report["env"]["continued_after"] == ["fault"] and not report["complete"]
    # the fresh process (the real script, the real parity_attn_res section) carries on from that report
    fresh = _child("import runpy; sys.argv = ['gpu_check.py', *" + repr(args[1:]) + "]\n"
                   "runpy.run_path('bench/gpu_check.py', run_name='__main__')\n",
                   env={"TRITON_INTERPRET": "1", "OUT": str(tmp_path)})
    assert fresh.returncode == 1, fresh.stdout + fresh.stderr  # the fault's error result still counts
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    names = [r["name"] for r in report["results"]]
    assert names[:4] == ["first", "first time", "fault", "fault time"] and names[-1] == "parity_attn_res time"
    assert any(n.startswith("attn_res ") for n in names[4:]) and report["complete"], names
    assert report["env"]["continued_after"] == ["fault"] and report["failed"] == 1


def test_kda_state_config_probe_reports_ok_and_faults():
    """A probe process checks one state-kernel entry against the fp64 reference (interpreter, fp32, tiny) and
    says 'ok'; a probe that dies says 'fault' with the error's last line."""
    sys.path.insert(0, str(BENCH))
    import gpu_check_kda_configs as kc

    env = {"TRITON_INTERPRET": "1"}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        assert kc.probe((16, 4, 2), 16, 2, 70, "cpu") == "ok"
        dead = kc.probe((16, 4, 2), 8, 2, 70, "cpu")  # K = 8 is below the kernels' head-dim limit: refused
    finally:
        for k, v in old.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    assert dead.startswith("fault: ") and "K=8" in dead, dead
