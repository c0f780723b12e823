"""Prefix-cache figures on the CPU: requests sharing a long prompt prefix, served with and without
the cache in one run.

Exports `--preset` (random fp32 weights) with `--serving` (ort flavor) into a temp folder, then serves
`--requests` prompts of one shared `--prefix`-token prefix plus a distinct `--suffix`-token tail each (greedy,
`--new` tokens each) through the ORT serving runner, plain and with `--prefix-cache`, the two runs interleaved
`--repeats` times (median wall time): prefill tokens computed, wall time, their ratios, identical tokens, and
the snapshot memory (bytes of one KDA snapshot, snapshots taken, the cache's peak, per sequence).
Prints a table and writes JSON (--json).

    python -m k3x.bench.prefix_cache [--preset k3-bench] [--prefix 2000] [--requests 16] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path


def serve_once(runner, cfg, prompts: list[list[int]], a, cache: bool) -> tuple[float, list, dict]:
    """One run -> (seconds, records, prefix-cache figures)."""
    from k3x.runtime.serve import ServeOptions, serve
    from k3x.text.sampling import SamplingOptions

    opts = ServeOptions(max_sequences=a.max_sequences, block_size=a.block_size, max_step_tokens=a.max_step_tokens,
                        prefix_cache=cache, prefix_cache_bytes=int(a.budget_mb * 1e6))
    stats: dict = {}
    t = time.perf_counter()
    records = serve(runner, cfg, prompts, SamplingOptions(max_new_tokens=a.new), opts, stats=stats)
    return time.perf_counter() - t, records, stats


def figures(a, runs: dict[bool, list], prompt_tokens: int) -> dict:
    plain, cached = runs[False], runs[True]
    computed = {k: prompt_tokens - sum(r.cached for r in v[0][1]) for k, v in runs.items()}
    secs = {k: statistics.median(s for s, _, _ in v) for k, v in runs.items()}
    stats = cached[0][2]
    return {"preset": a.preset, "requests": a.requests, "prefix": a.prefix, "suffix": a.suffix, "new": a.new,
            "block_size": a.block_size, "max_sequences": a.max_sequences, "max_step_tokens": a.max_step_tokens,
            "prompt_tokens": prompt_tokens, "prefill_tokens_plain": computed[False],
            "prefill_tokens_cached": computed[True], "prefill_ratio": computed[False] / computed[True],
            "hits": sum(r.cached > 0 for r in cached[0][1]), "seconds_plain": secs[False],
            "seconds_cached": secs[True], "speedup": secs[False] / secs[True],
            "tokens_equal": all([r.tokens for r in run[1]] == [r.tokens for r in plain[0][1]]
                                for run in plain + cached),
            **stats, "snapshot_bytes_per_sequence": stats["cache_peak_bytes"] / a.requests}


def table(r: dict) -> str:
    mb = 1e6
    return (f"{r['preset']}, ORT CPU: {r['requests']} requests = a {r['prefix']:,}-token shared prefix + "
            f"{r['suffix']} tokens each, {r['new']} new tokens\n"
            f"  {'':<16}{'prefill tokens':>16}{'wall s':>10}\n"
            f"  {'no cache':<16}{r['prefill_tokens_plain']:>16,}{r['seconds_plain']:>10.1f}\n"
            f"  {'prefix cache':<16}{r['prefill_tokens_cached']:>16,}{r['seconds_cached']:>10.1f}\n"
            f"  {'ratio':<16}{r['prefill_ratio']:>15.1f}x{r['speedup']:>9.1f}x\n"
            f"  hits {r['hits']}/{r['requests']}; tokens equal: {r['tokens_equal']}\n"
            f"  snapshots: {r['snapshot_bytes'] / mb:.2f} MB each, {r['snapshots_stored']} taken, "
            f"{r['snapshots_evicted']} evicted; cache peak {r['cache_peak_bytes'] / mb:.1f} MB = "
            f"{r['snapshot_bytes_per_sequence'] / mb:.2f} MB per sequence")


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="k3-bench")
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--prefix", type=int, default=2000)
    p.add_argument("--suffix", type=int, default=32)
    p.add_argument("--new", type=int, default=4)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-sequences", type=int, default=8)
    p.add_argument("--max-step-tokens", type=int, default=512)
    p.add_argument("--budget-mb", type=float, default=1024.0)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--threads", type=int, default=0, help="ONNX Runtime intra-op threads (0: its default)")
    p.add_argument("--json", type=Path)
    a = p.parse_args(argv)
    import torch

    from k3x.exporter.options import ExportOptions, Target
    from k3x.exporter.pipeline import export
    from k3x.model import preset
    from k3x.runtime.runners import RunnerOptions
    from k3x.runtime.serve import serving_runner

    cfg = preset(a.preset)
    g = torch.Generator().manual_seed(0)
    shared = torch.randint(0, cfg.vocab_size, (a.prefix,), generator=g).tolist()
    prompts = [shared + torch.randint(0, cfg.vocab_size, (a.suffix,), generator=g).tolist()
               for _ in range(a.requests)]
    with tempfile.TemporaryDirectory() as tmp:
        export(ExportOptions((Target.ONNX,), Path(tmp) / "x", preset=a.preset, serving=True, block_size=a.block_size))
        runner = serving_runner("ort", Path(tmp) / "x", RunnerOptions(intra_op_threads=a.threads))
        runs: dict[bool, list] = {False: [], True: []}
        for i in range(a.repeats):
            for cache in ((False, True) if i % 2 == 0 else (True, False)):  # each first in turn
                runs[cache].append(serve_once(runner, cfg, prompts, a, cache))
    r = figures(a, runs, sum(map(len, prompts)))
    print(table(r))
    if a.json:
        a.json.write_text(json.dumps(r, indent=1) + "\n")
    if not r["tokens_equal"]:
        raise SystemExit("prefix cache: the cached runs' tokens differ from the plain run's")
    return r


if __name__ == "__main__":
    main()
