"""Where the batching speedup goes ("batching pays"): one sequence's decode step and --batch
sequences', split by part from ONNX Runtime's profile, with each part's own speedup.

Through the ORT serving runner on a flat serving export of `--preset` (default k3-bench; or `--export DIR`
exported with --no-onnx-functions), the two steps of bench/serving.py (one sequence; --batch sequences in
consecutive slots, all at --positions) interleaved in rounds on one profiled session. Every profiled node's
kernel time goes to one part:
  - lm_head, dense GEMMs: Gemm / MatMul nodes of the main graph (projections, shared experts, dense MLP);
  - routed experts: the k3::MoE call (routing, every expert's GEMMs, the combine);
  - KDAPacked (KDA recurrence over the pools), KDAPrep (short conv, gates), MLAPaged (attention over the
    latent pool): the mixers' own calls;
  - other: norms, AttnRes, GLUs, reshapes.
A part's speedup is batch x (its time in the one-sequence step) / (its time in the batch step): the whole
step's speedup is those parts' speedups weighted by their share of the batch step. A part under the goal
pulls the step under it: on a 2-core AVX2 machine the KDA recurrence (each sequence's state read and
written every step, in memory, not in weights shared by the batch) batches at ~2x. Node times carry the
profiler's per-node cost: a few percent over an unprofiled step (bench/serving.py has the unprofiled figure).
Across the parts, the step's GEMM nodes (every Gemm / MatMul node wherever it runs: the head, the dense ones,
each routed expert's in k3::MoE's body; the mixers' bodies' too where the kernel library is not built) against
the rest: where the GEMMs themselves batch under the goal, the step does too unless the rest batches better
(the KDA recurrence does not).

    python -m k3x.bench.serving_parts [--preset k3-bench] [--export DIR] [--batch 32] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from k3x.bench.serving_steps import (StepCase, inlined_callers, kernel_nodes, owner, profiled_rounds, run_bench,
                                     run_of)

GEMMS = ("Gemm", "MatMul", "FusedGemm", "FusedMatMul")
CALLS = {"MoE": "routed experts", "KDAPacked": "KDAPacked", "KDAPrep": "KDAPrep", "MLAPaged": "MLAPaged"}
PARTS = ("lm_head", "dense GEMMs", "routed experts", "KDAPacked", "KDAPrep", "MLAPaged", "other")
GEMM_NODES, REST = "GEMM nodes", "the rest"  # the same node time across the parts; the rest = all - GEMM nodes


def part_of(name: str, op: str, inlined: dict[str, tuple[str, bool]], called: dict[str, str]) -> str:
    """The part a profiled node's time goes to: the function its main-graph node calls (a body ORT inlined,
    or the node itself when the kernel library runs it), else its own op type."""
    main, _ = owner(name, inlined)
    kind = called.get(main, op)
    if kind in CALLS:
        return CALLS[kind]
    if main == name and op in GEMMS:
        return "lm_head" if "/lm_head/" in name else "dense GEMMs"
    return "other"


def split_runs(profile: Path, callers: dict[str, list[str]], cfg=None) -> list[dict[str, float]]:
    """Per run of the session (in order): ms of node kernel time by part (PARTS), and of the GEMM nodes across
    them (GEMM_NODES). (`cfg`: unused, the split signature of serving_steps.profiled_rounds.)"""
    events = json.loads(profile.read_text())
    nodes = kernel_nodes(events)
    starts = [e["ts"] for e in events if e.get("name") == "model_run"]
    inlined = inlined_callers([e for e in nodes if e["ts"] >= starts[-1]], callers)
    called = {node: fn for fn, names in callers.items() for node in names}
    out = [dict.fromkeys((*PARTS, GEMM_NODES), 0.0) for _ in starts]
    for e in nodes:
        name, op, run = e["name"][: -len("_kernel_time")], e["args"].get("op_name", ""), out[run_of(e, starts)]
        run[part_of(name, op, inlined, called)] += e["dur"] / 1e3
        if op in GEMMS:
            run[GEMM_NODES] += e["dur"] / 1e3
    return out


def measure(path: Path, a: argparse.Namespace) -> dict:
    def steps(runner, cfg, bs) -> dict:
        return {b: StepCase(cfg, batch=b, positions=a.positions + 1, capacity=a.small, block_size=bs).timer(
            runner, 1, a.positions) for b in (1, a.batch)}
    cfg, ms, runs = profiled_rounds(path, a, steps, split_runs)
    # each part's median over the timed steps; `all` is the parts' sum, so the rows add up and the step's
    # speedup is exactly the parts' speedups weighted by their share of the batch step
    node_ms = {b: {p: statistics.median(r[p] for r in runs[b]) for p in (*PARTS, GEMM_NODES)} for b in (1, a.batch)}
    for parts in node_ms.values():
        parts["all"] = sum(parts[p] for p in PARTS)
        parts[REST] = parts["all"] - parts[GEMM_NODES]
    rows = [{"part": p, "ms_1": node_ms[1][p], "ms_batch": node_ms[a.batch][p],
             "speedup": a.batch * node_ms[1][p] / node_ms[a.batch][p] if node_ms[a.batch][p] else None}
            for p in (*PARTS, "all", GEMM_NODES, REST)]
    return {"preset": cfg.name, "threads": a.threads, "positions": a.positions, "batch": a.batch,
            "rounds": a.rounds, "repeats": a.repeats, "step_ms_1": statistics.median(ms[1]),
            "step_ms_batch": statistics.median(ms[a.batch]),
            "split_by": "ONNX Runtime node profile of the serving ONNX (ort flavor)", "rows": rows}


def table(r: dict) -> str:
    b = r["batch"]
    head = (f"{r['preset']}, ORT CPU, {r['threads']} threads, decode steps at {r['positions']} positions: node "
            f"kernel time by part (median of {r['rounds']} rounds x {r['repeats']}; profiled steps "
            f"{r['step_ms_1']:.2f} and {r['step_ms_batch']:.2f} ms):")
    lines = [head, f"  {'part':<16} {'1 seq ms':>9} {f'{b} seq ms':>10} {f'{b} x t1 / t{b}':>12} {'share':>7}"]
    total = next(x["ms_batch"] for x in r["rows"] if x["part"] == "all")
    for x in r["rows"]:
        speedup = "-" if x["speedup"] is None else f"{x['speedup']:.2f}"
        if x["part"] == GEMM_NODES:
            lines.append("  across the parts:")
        lines.append(f"  {x['part']:<16} {x['ms_1']:>9.2f} {x['ms_batch']:>10.2f} {speedup:>12} "
                     f"{x['ms_batch'] / total:>7.1%}")
    return "\n".join(lines + ["  (share: of the batch step's node time; the step's speedup is the parts' "
                              "speedups weighted by it)"])


def arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--small", type=int, default=4096, help="pool capacity in positions")
    p.add_argument("--positions", type=int, default=64)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--repeats", type=int, default=4, help="timed steps of each case per round")


def main(argv: list[str] | None = None) -> dict:
    return run_bench(argv, __doc__, arguments, measure, table)


if __name__ == "__main__":
    main()
