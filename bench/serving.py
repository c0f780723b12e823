"""Serving-step figures on the CPU: flat in pool capacity, and what batching pays.

Through the ORT serving runner (IO binding: the pools are bound by pointer every step, no copy) on a serving
export of `--preset` (default k3-bench, random fp32 weights; or `--export DIR`), one decode step each of:
  - small: one sequence with --positions positions in its state, pools for --small positions;
  - large: the same with a latent pool for --large positions (default 1,048,576);
  - many:  --batch sequences decoding together (each at --positions), pools for what they hold, in
           consecutive slots (their KDA rows are read and written in place, runtime/step_outputs.py);
  - scattered: the same in slots that are not consecutive (scratch outputs, then the write-back), timed
    after the others, interleaved with `small` alone: the fallback path. serve() keeps its running
    sequences in consecutive slots (runtime/scheduler.py `compact`), so its steps take it only with drafts.
The cases are interleaved (each first in turn), --repeats per round, --rounds rounds; the figures are the
median over rounds and the spread (lowest-highest round). Capacity ratio = large / small, batching speedup
= batch x small / many, both taken round by round. Prints a table and writes JSON (--json).

    python -m k3x.bench.serving [--preset k3-bench] [--export DIR] [--large 1048576] [--batch 32] [--json out.json]
"""

from __future__ import annotations

import argparse
from pathlib import Path

from k3x.bench.serving_steps import StepCase, fmt, open_serving, run_bench, summary, timed_rounds


def measure(path: Path, a: argparse.Namespace) -> dict:
    runner, cfg, bs = open_serving(path, a.threads)
    kw = {"positions": a.positions + 1, "block_size": bs}
    cases = {"small": StepCase(cfg, batch=1, capacity=a.small, **kw),
             "large": StepCase(cfg, batch=1, capacity=a.large, **kw),
             "many": StepCase(cfg, batch=a.batch, capacity=a.small, **kw)}
    ms = timed_rounds({k: c.timer(runner, 1, a.positions) for k, c in cases.items()}, a.rounds, a.repeats)
    # apart, against its own one-sequence steps: a fourth case's memory in the same rounds would evict theirs
    cases["scattered"] = StepCase(cfg, batch=a.batch, capacity=a.small, scattered=True, **kw)
    apart = timed_rounds({k: cases[k].timer(runner, 1, a.positions) for k in ("small", "scattered")}, a.rounds,
                         a.repeats)
    rounds = range(a.rounds)
    return {"preset": cfg.name, "threads": a.threads, "positions": a.positions, "small_pool": a.small,
            "large_pool": a.large, "large_pool_bytes": cases["large"].pools.nbytes, "batch": a.batch,
            "rounds": a.rounds, "repeats": a.repeats,
            "decode_ms_small_pool": summary(ms["small"]), "decode_ms_large_pool": summary(ms["large"]),
            "capacity_ratio": summary([ms["large"][i] / ms["small"][i] for i in rounds]),
            "step_ms_batch": summary(ms["many"]),
            "tokens_per_s_1": summary([1e3 / x for x in ms["small"]]),
            "tokens_per_s_batch": summary([a.batch * 1e3 / x for x in ms["many"]]),
            "batching_speedup": summary([a.batch * ms["small"][i] / ms["many"][i] for i in rounds]),
            "step_ms_batch_scattered": summary(apart["scattered"]),
            "batching_speedup_scattered": summary([a.batch * apart["small"][i] / apart["scattered"][i]
                                                   for i in rounds])}


def table(r: dict) -> str:
    b = r["batch"]
    rows = [
        (f"1 sequence, pool for {r['small_pool']:,} positions (ms)", fmt(r["decode_ms_small_pool"])),
        (f"1 sequence, pool for {r['large_pool']:,} positions (ms)", fmt(r["decode_ms_large_pool"])),
        ("capacity ratio large / small (goal <= 1.2)", fmt(r["capacity_ratio"], 3)),
        (f"{b} sequences together: step (ms)", fmt(r["step_ms_batch"])),
        ("1 sequence alone: tokens/s", fmt(r["tokens_per_s_1"], 1)),
        (f"{b} sequences together: tokens/s", fmt(r["tokens_per_s_batch"], 1)),
        ("batching speedup (goal >= 10)", fmt(r["batching_speedup"])),
        (f"{b} sequences in scattered slots: step (ms)", fmt(r["step_ms_batch_scattered"])),
        ("batching speedup, scattered slots", fmt(r["batching_speedup_scattered"]))]
    head = (f"{r['preset']}, ORT CPU, {r['threads']} threads, decode steps at {r['positions']} positions "
            f"(median [lowest-highest] of {r['rounds']} rounds x {r['repeats']}):")
    return "\n".join([head] + [f"  {k:<46} {v:>28}" for k, v in rows])


def arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--large", type=int, default=1 << 20)
    p.add_argument("--small", type=int, default=4096)
    p.add_argument("--positions", type=int, default=64)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--repeats", type=int, default=6, help="timed steps of each case per round")


def main(argv: list[str] | None = None) -> dict:
    return run_bench(argv, __doc__, arguments, measure, table)


if __name__ == "__main__":
    main()
