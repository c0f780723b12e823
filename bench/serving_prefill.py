"""ORT prefill on the serving step against the fp32 GEMM bound measured in the same run.

One sequence's prompt of --prompt tokens as one serving step (ORT serving runner, serving export of `--preset`,
default k3-bench; or `--export DIR`) against the GEMM bound: matmuls of the model's own weight shapes on the
same rows with the same thread count -- every linear layer on the prompt's rows (the head on the one logits
row the step computes), the router, and each routed expert's gate/up/down on its share of the prompt x top_k
routed rows (balanced). bound tokens/s = prompt / (time of those matmuls); efficiency = ORT tokens/s / bound
(goal >= 80%). The matmuls run three ways, each with its own distinct weights: torch on the bench's threads,
torch on one thread (on an oversubscribed machine OpenMP's barriers can make N threads slower than one), and
ONNX Runtime Gemm nodes with their weights as initializers (its MLAS kernels on prepacked weights, as the
model's own Gemms run, outputs in buffers bound once; on the 2-core development machine 6-9 % faster than
torch's at k3-bench's shapes). The fastest is the honest bound
(`efficiency_best_bound`); `efficiency` keeps the torch figure of earlier runs. All cases are interleaved in
rounds (median and spread), each call after an idle pause (serving_steps.timed_rounds), ORT on a session
without the profiler; ONNX Runtime's node profile of a second, profiled session's prefills after the timed
rounds gives the top ops (function bodies by function/step, other nodes by op type).

    python -m k3x.bench.serving_prefill [--preset k3-bench] [--export DIR] [--prompt 128] [--json out.json]

The default prompt, 128 tokens, is the one the project's prefill target was set on (a 128-token prompt
on 2 threads, `--preset kimi-linear-mid`: the target's mid-size Kimi Linear); longer prompts show where the
serving step falls behind the bound.
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
import time
from collections import defaultdict
from pathlib import Path

from k3x.bench.serving_steps import StepCase, fmt, open_serving, run_bench, summary, timed_rounds


def gemm_shapes(cfg, prompt: int) -> list[tuple[int, int, int, int]]:
    """(count, rows, in, out) of the matmuls of one prefill of `prompt` tokens (weights of a meta model)."""
    from torch import nn

    from k3x.model import build_model
    from k3x.model.moe import Router, StackedExperts

    model = build_model(cfg, device="meta", seed=None)
    out = []
    for name, m in model.named_modules():
        if isinstance(m, nn.Linear):
            out.append((1, 1 if name.endswith("lm_head") else prompt, m.in_features, m.out_features))
        elif isinstance(m, StackedExperts):  # routed experts, [E, I, L] / [E, L, I]
            E, inter, latent = m.w1.shape
            rows = math.ceil(prompt * cfg.moe.top_k / E)
            out += [(2 * E, rows, latent, inter), (E, rows, inter, latent)]
        elif isinstance(m, Router):
            out.append((1, prompt, m.weight.shape[1], m.weight.shape[0]))
    return out


def gemm_timer(shapes: list[tuple[int, int, int, int]], threads: int):
    """(a function timing one pass over every matmul on `threads` torch threads, its FLOPs). Distinct weights
    per count (no cache reuse a real model does not get)."""
    import torch

    mats = [(torch.randn(r, i), [torch.randn(i, o) for _ in range(c)]) for c, r, i, o in shapes]
    flops = sum(2 * c * r * i * o for c, r, i, o in shapes)

    def one() -> float:
        torch.set_num_threads(threads)
        t = time.perf_counter()
        for x, ws in mats:
            for w in ws:
                torch.mm(x, w)
        return time.perf_counter() - t
    one(), one()  # torch's thread pool and kernels warmed up
    return one, flops


def ort_gemm_timer(shapes: list[tuple[int, int, int, int]], threads: int, folder: Path):
    """A function timing one pass over every matmul as ONNX Runtime Gemm nodes (x @ wᵀ, w an initializer:
    prepacked at load like the model's weights), on a session opened as the serving runner's (`ort_session`),
    the model written to `folder`. Distinct weights per count, as `gemm_timer`. Inputs and outputs are bound
    once to buffers allocated here (IO binding, as the serving runner runs): the timed pass is the Gemms alone,
    no output allocated or handed back to Python (which made the pass ~2 % slower, a lenient bound)."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    from k3x.runtime.ort_runner import import_onnxruntime, ort_session

    rng = np.random.default_rng(0)
    nodes, weights, inputs, feeds, outs = [], [], [], {}, {}
    for s, (count, rows, i, o) in enumerate(shapes):
        x = f"x{s}"
        inputs.append(helper.make_tensor_value_info(x, TensorProto.FLOAT, [rows, i]))
        feeds[x] = rng.standard_normal((rows, i), dtype=np.float32)
        for j in range(count):
            weights.append(numpy_helper.from_array(rng.standard_normal((o, i), dtype=np.float32), f"w{s}_{j}"))
            nodes.append(helper.make_node("Gemm", [x, weights[-1].name], [f"y{s}_{j}"], transB=1))
            outs[nodes[-1].output[0]] = [rows, o]
    outputs = [helper.make_tensor_value_info(n.output[0], TensorProto.FLOAT, None) for n in nodes]  # none pruned
    model = helper.make_model(helper.make_graph(nodes, "gemms", inputs, outputs, weights),
                              opset_imports=[helper.make_opsetid("", 20)], ir_version=10)
    onnx.save(model, folder / "gemms.onnx", save_as_external_data=True, location="gemms.bin")
    session, _ = ort_session(folder / "gemms.onnx", "cpu", threads)
    ort = import_onnxruntime()
    binding, buffers = session.io_binding(), []
    for name, value in feeds.items():
        binding.bind_cpu_input(name, value)
    for name, shape in outs.items():
        buffers.append(ort.OrtValue.ortvalue_from_shape_and_type(shape, np.float32, "cpu"))
        binding.bind_ortvalue_output(name, buffers[-1])

    def one() -> float:
        t = time.perf_counter()
        session.run_with_iobinding(binding)
        return time.perf_counter() - t
    one(), one()  # lazy inits, pages touched
    return one


def top_ops(profile: Path, skip_runs: set[int], n: int = 12) -> tuple[list[dict], list[dict]]:
    """Node kernel time over the profiled runs not in `skip_runs`, an inlined function body's nodes as
    `<function>/<step>: <op>`, other nodes as `graph: <op>` -> (the `n` largest ops, every group without the
    op), each with ms per run and share."""
    from k3x.bench.serving_steps import INLINED, kernel_nodes, run_of

    events = json.loads(profile.read_text())
    starts = [e["ts"] for e in events if e.get("name") == "model_run"]
    keep = [i for i in range(len(starts)) if i not in skip_runs]
    by = defaultdict(float)
    for e in kernel_nodes(events):
        if run_of(e, starts) in skip_runs:
            continue
        m = INLINED.search(e["name"])
        step = e["name"][m.end():].split("/")[0] if m else ""
        by[f"{m.group(1)}/{step}" if m else "graph"] += e["dur"]
        by[(f"{m.group(1)}/{step}" if m else "graph") + ": " + e["args"]["op_name"]] += e["dur"]
    total = sum(v for k, v in by.items() if ": " not in k)
    ranked = sorted(by.items(), key=lambda kv: -kv[1])
    row = [{"op": k, "ms_per_run": v / 1e3 / len(keep), "share": v / total} for k, v in ranked]
    return [o for o in row if ": " in o["op"]][:n], [o for o in row if ": " not in o["op"]]


def timed(path: Path, a: argparse.Namespace) -> tuple:
    """(per case its per-round ms, config, block size, GEMM FLOPs): the ORT prefill on a session WITHOUT the
    profiler (its per-node cost stays out of the timed figure), interleaved with the GEMM bound passes."""
    runner, cfg, bs = open_serving(path, a.threads)
    shapes = gemm_shapes(cfg, a.prompt)
    gemm, flops = gemm_timer(shapes, a.threads)
    case = StepCase(cfg, batch=1, positions=a.prompt, capacity=a.prompt, block_size=bs)
    with tempfile.TemporaryDirectory(prefix="k3x-gemms-") as tmp:
        steps = {"ort": case.timer(runner, a.prompt, 0), "gemm": gemm, "gemm_1": gemm_timer(shapes, 1)[0],
                 "gemm_ort": ort_gemm_timer(shapes, a.threads, Path(tmp))}
        return timed_rounds(steps, a.rounds, a.repeats), cfg, bs, flops


def profiled_ops(path: Path, a: argparse.Namespace, cfg, bs: int) -> tuple[list[dict], list[dict]]:
    """`top_ops` of a second, profiled session opened after the timed rounds: one prefill for its lazy inits
    (not counted), then `--repeats` profiled prefills of the same prompt."""
    with tempfile.TemporaryDirectory(prefix="k3x-prof-") as tmp:
        runner, _, _ = open_serving(path, a.threads, profile=str(Path(tmp) / "ort"))
        step = StepCase(cfg, batch=1, positions=a.prompt, capacity=a.prompt, block_size=bs).timer(runner, a.prompt, 0)
        for _ in range(1 + a.repeats):
            step()
        return top_ops(Path(runner.session.end_profiling()), skip_runs={0})


def measure(path: Path, a: argparse.Namespace) -> dict:
    from k3x.runtime.ort_kernels import library, sources

    ms, cfg, bs, flops = timed(path, a)
    ops, groups = profiled_ops(path, a, cfg, bs)
    rounds = range(a.rounds)
    return {"preset": cfg.name, "threads": a.threads, "prompt": a.prompt, "rounds": a.rounds, "repeats": a.repeats,
            "ort_kernels": sorted(sources()) if library() else [],
            "gemm_gflop_per_token": flops / a.prompt / 1e9,
            "ort_prefill_ms": summary(ms["ort"]), "gemm_ms": summary(ms["gemm"]),
            "ort_tokens_per_s": summary([a.prompt * 1e3 / x for x in ms["ort"]]),
            "gemm_bound_tokens_per_s": summary([a.prompt * 1e3 / x for x in ms["gemm"]]),
            "gemm_gflop_per_s": summary([flops / x / 1e6 for x in ms["gemm"]]),
            "gemm_gflop_per_s_1_thread": summary([flops / x / 1e6 for x in ms["gemm_1"]]),
            "gemm_ort_ms": summary(ms["gemm_ort"]),
            "gemm_gflop_per_s_ort": summary([flops / x / 1e6 for x in ms["gemm_ort"]]),
            "efficiency": summary([ms["gemm"][i] / ms["ort"][i] for i in rounds]),
            "efficiency_best_bound": summary([min(ms["gemm"][i], ms["gemm_1"][i], ms["gemm_ort"][i]) / ms["ort"][i]
                                              for i in rounds]),
            "top_ops": ops, "groups": groups}


def table(r: dict) -> str:
    rows = [("ORT prefill (ms)", fmt(r["ort_prefill_ms"], 1)),
            ("GEMM bound: the model's matmuls, torch (ms)", fmt(r["gemm_ms"], 1)),
            ("the same matmuls, ONNX Runtime Gemm (ms)", fmt(r["gemm_ort_ms"], 1)),
            (f"fp32 GEMM speed, {r['threads']} torch threads (GFLOP/s)", fmt(r["gemm_gflop_per_s"], 1)),
            ("fp32 GEMM speed, 1 torch thread (GFLOP/s)", fmt(r["gemm_gflop_per_s_1_thread"], 1)),
            (f"fp32 GEMM speed, ONNX Runtime, {r['threads']} threads (GFLOP/s)", fmt(r["gemm_gflop_per_s_ort"], 1)),
            ("ORT prefill tokens/s", fmt(r["ort_tokens_per_s"], 1)),
            ("GEMM-bound tokens/s (torch)", fmt(r["gemm_bound_tokens_per_s"], 1)),
            ("efficiency ORT / torch bound", fmt(r["efficiency"], 3)),
            ("efficiency vs the fastest bound (goal >= 0.80)", fmt(r["efficiency_best_bound"], 3))]
    lines = [f"{r['preset']}, CPU, {r['threads']} threads, one {r['prompt']}-token prompt as one serving step "
             f"({r['gemm_gflop_per_token']:.3f} GFLOP/token of GEMMs; median [lowest-highest] of {r['rounds']} "
             f"rounds x {r['repeats']}; ONNX Runtime CPU kernels: "
             f"{', '.join(r['ort_kernels']) or 'none (k3x build-ort-kernels)'}):"] + \
        [f"  {k:<48} {v:>24}" for k, v in rows]
    lines.append("  top ops of the ORT prefill (node kernel time per step, share of all nodes):")
    lines += [f"    {o['op']:<40} {o['ms_per_run']:>9.1f} ms {100 * o['share']:>5.1f}%" for o in r["top_ops"]]
    lines.append("  by function body step (graph: nodes outside the k3 function bodies):")
    lines += [f"    {o['op']:<40} {o['ms_per_run']:>9.1f} ms {100 * o['share']:>5.1f}%" for o in r["groups"]]
    return "\n".join(lines)


def arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--repeats", type=int, default=2, help="timed prefills (and GEMM passes) per round")


def main(argv: list[str] | None = None) -> dict:
    return run_bench(argv, __doc__, arguments, measure, table)


if __name__ == "__main__":
    main()
