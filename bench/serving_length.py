"""Decode step time by context length, split by layer kind ("proportional to length").

One sequence's decode step at --lengths positions (default 1K, 16K, 64K) through the ORT serving runner on a
serving export of `--preset` (default k3-bench; or `--export DIR`), the cases interleaved in rounds (the state
is random: a step's time does not depend on its values). The split comes from ONNX Runtime's own profile of
the exported ONNX (the artifact itself, not the eager model): every node's kernel time is attributed to its
layer (the KDAPacked / MLAPaged / MoE / AttnRes function bodies ORT inlines, to the node that called them),
summed by layer kind (KDA layers, MLA layers, other: embedding, final norm, head) and for the mixers alone.
Expected: the KDA share constant in length, the MLA share growing with it. Wall times are medians over rounds
(with the profiler on: a few percent over an unprofiled step).

    python -m k3x.bench.serving_length [--preset k3-bench] [--export DIR] [--lengths 1024,16384,65536] [--json out]
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from k3x.bench.serving_steps import StepCase, fmt, profile_runs, profiled_rounds, run_bench, summary

PARTS = ("kda", "mla", "other", "kda_mixer", "mla_mixer")


def measure(path: Path, a: argparse.Namespace) -> dict:
    lengths = [int(x) for x in a.lengths.split(",")]

    def steps(runner, cfg, bs) -> dict:
        return {n: StepCase(cfg, batch=1, positions=n + 1, capacity=n + 1, block_size=bs).timer(runner, 1, n)
                for n in lengths}
    def split(profile: Path, callers: dict, cfg) -> list[dict]:
        return profile_runs(profile, callers, cfg.layer_types)
    cfg, ms, runs = profiled_rounds(path, a, steps, split)
    rows = []
    for n in lengths:
        parts = {k: statistics.median(r.get(k, 0.0) for r in runs[n]) / 1e3 for k in PARTS}
        rows.append({"positions": n, "step_ms": summary(ms[n]), **{f"{k}_ms": v for k, v in parts.items()},
                     "kda_layers": cfg.layer_types.count("kda"), "mla_layers": cfg.layer_types.count("mla")})
    return {"preset": cfg.name, "threads": a.threads, "rounds": a.rounds, "repeats": a.repeats,
            "split_by": "ONNX Runtime node profile of the serving ONNX (ort flavor)", "rows": rows}


def table(r: dict) -> str:
    head = (f"{r['preset']}, ORT CPU, {r['threads']} threads, one decode step by context length; layer shares "
            f"from ORT's node profile (median of {r['rounds']} rounds x {r['repeats']}):")
    cols = f"  {'positions':>9} {'step ms [spread]':>28} {'KDA layers':>11} {'MLA layers':>11} {'other':>7} " \
           f"{'KDA mixers':>11} {'MLA mixers':>11}"
    lines = [head, cols]
    for x in r["rows"]:
        lines.append(f"  {x['positions']:>9,} {fmt(x['step_ms']):>28} {x['kda_ms']:>11.2f} {x['mla_ms']:>11.2f} "
                     f"{x['other_ms']:>7.2f} {x['kda_mixer_ms']:>11.2f} {x['mla_mixer_ms']:>11.2f}")
    return "\n".join(lines + ["  (ms of node kernel time; layers = mixer + AttnRes + MLP of KDA / MLA layers)"])


def arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--lengths", default="1024,16384,65536")
    p.add_argument("--repeats", type=int, default=4, help="timed steps of each length per round")


def main(argv: list[str] | None = None) -> dict:
    return run_bench(argv, __doc__, arguments, measure, table)


if __name__ == "__main__":
    main()
