"""Continuous batching end to end on a mixed workload (CPU, ORT): what `k3x run --prompts` delivers when
prompts of different lengths arrive together and finish at different times.

--prompts random prompts (seeded) of 1..--max-prompt tokens, each with 8..--max-new new tokens (greedy),
through runtime/serve.py `serve()` on --sequences slots and --step-tokens tokens a step, --rounds times on
one session. Each step is timed and sorted by what it holds: decode rows only, prompt chunks only, or both
(mixed: the KDA and MLA bodies then run the decode rows apart from the chunks, custom_ops/*/onnx.py
`_split`), and whether its slots were consecutive (in place, runtime/step_outputs.py; serve() keeps them
so); the step figures are the last round's. The records of every round must be the same tokens.

    python -m k3x.bench.serving_mixed [--export DIR] [--prompts 96] [--sequences 32] [--json out.json]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from pathlib import Path

from k3x.bench.serving_steps import fmt, open_serving, run_bench, summary


def workload(vocab: int, a: argparse.Namespace) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(a.seed)
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(1, a.max_prompt))] for _ in range(a.prompts)]
    return prompts, [rng.randint(min(8, a.max_new), a.max_new) for _ in prompts]


def kind(lengths: list[int]) -> str:
    ones = sum(n == 1 for n in lengths)
    return "decode" if ones == len(lengths) else "prefill" if ones == 0 else "mixed"


def measure(path: Path, a: argparse.Namespace) -> dict:
    from k3x.runtime.serve import ServeOptions, serve
    from k3x.runtime.step_outputs import consecutive_start
    from k3x.text.sampling import SamplingOptions

    runner, cfg, bs = open_serving(path, a.threads)
    prompts, news = workload(cfg.vocab_size, a)
    steps: list[tuple[str, bool, float]] = []
    infer = runner.infer

    def timed(feeds, **kw):
        t = time.perf_counter()
        out = infer(feeds, **kw)
        seconds = time.perf_counter() - t
        cu = feeds["cu_seqlens"].tolist()
        steps.append((kind([e - s for s, e in zip(cu, cu[1:])]), consecutive_start(feeds["slots"]) is not None,
                      seconds))
        return out

    runner.infer = timed
    options = ServeOptions(max_sequences=a.sequences, block_size=bs, max_step_tokens=a.step_tokens)
    walls, tokens = [], None
    for _ in range(a.rounds):
        steps.clear()
        t = time.perf_counter()
        records = serve(runner, cfg, prompts, SamplingOptions(max_new_tokens=a.max_new), options, max_new_tokens=news)
        walls.append(time.perf_counter() - t)
        got = [r.tokens for r in records]
        if tokens is not None and got != tokens:
            raise RuntimeError("serving_mixed: a round gave other tokens than the first")
        tokens = got
    new = sum(map(len, tokens))
    by_kind = {k: [s for kk, _, s in steps if kk == k] for k in ("decode", "prefill", "mixed")}
    return {"preset": cfg.name, "threads": a.threads, "prompts": a.prompts, "prompt_tokens": sum(map(len, prompts)),
            "new_tokens": new, "sequences": a.sequences, "step_tokens": a.step_tokens, "rounds": a.rounds,
            "seconds": summary(walls), "new_tokens_per_s": summary([new / w for w in walls]),
            "steps": len(steps), "consecutive_share": sum(c for _, c, _ in steps) / len(steps),
            "steps_by_kind": {k: len(v) for k, v in by_kind.items()},
            "step_ms_by_kind": {k: 1e3 * statistics.median(v) for k, v in by_kind.items() if v}}


def table(r: dict) -> str:
    rows = [("prompts (prompt tokens / new tokens)", f"{r['prompts']} ({r['prompt_tokens']:,} / {r['new_tokens']:,})"),
            ("wall time (s)", fmt(r["seconds"], 1)),
            ("new tokens/s", fmt(r["new_tokens_per_s"], 1)),
            ("steps (decode / prefill / mixed)", "{} ({decode} / {prefill} / {mixed})".format(
                r["steps"], **r["steps_by_kind"])),
            ("step ms, median (decode / prefill / mixed)", " / ".join(
                f"{r['step_ms_by_kind'][k]:.0f}" if k in r["step_ms_by_kind"] else "-"
                for k in ("decode", "prefill", "mixed"))),
            ("steps in consecutive slots (in place)", f"{r['consecutive_share']:.2f}")]
    head = (f"{r['preset']}, ORT CPU, {r['threads']} threads, serve() on {r['sequences']} slots, "
            f"{r['step_tokens']} tokens a step (median [lowest-highest] of {r['rounds']} rounds):")
    return "\n".join([head] + [f"  {k:<44} {v:>30}" for k, v in rows])


def arguments(p: argparse.ArgumentParser) -> None:
    p.set_defaults(rounds=2)
    p.add_argument("--prompts", type=int, default=96)
    p.add_argument("--max-prompt", type=int, default=300, help="prompt lengths 1..this")
    p.add_argument("--max-new", type=int, default=64, help="new tokens 8..this per prompt")
    p.add_argument("--sequences", type=int, default=32, help="slots (sequences served at once)")
    p.add_argument("--step-tokens", type=int, default=512, help="tokens a step (ServeOptions.max_step_tokens)")
    p.add_argument("--seed", type=int, default=0)


def main(argv: list[str] | None = None) -> dict:
    return run_bench(argv, __doc__, arguments, measure, table)


if __name__ == "__main__":
    main()
