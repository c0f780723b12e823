"""Serving-step figures on the CPU (issue 20): flat in pool capacity, and what batching pays.

Exports `--preset` (random fp32 weights) with `--serving` (ort flavor) into a temp folder, then through the
ORT serving runner (IO binding: the pools are bound by pointer every step, no copy):
  - capacity: one sequence with 64 positions in its state, one decode step (median of --repeats, the cases
    interleaved), with a latent pool sized for --small positions vs --large positions -> ms and the ratio;
  - batching: --batch sequences decoding together (each at 64 positions) vs one -> decode tokens/s.
Prints a table and writes JSON (--json).

    python -m k3x.bench.serving [--preset k3-mini] [--large 1048576] [--small 4096] [--batch 32] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path


def decode_step(runner, cfg, *, positions: int, batch: int, capacity: int, block_size: int):
    """A function timing (seconds) one decode step of `batch` sequences at `positions` past positions, with
    pools for `capacity` positions (latent blocks; at least what the batch holds) and `batch` slots. The
    state is filled by one prefill step first."""
    import torch

    from k3x.model.state import blocks_for
    from k3x.runtime.pools import StatePools

    per = blocks_for(positions + 1, block_size)
    blocks = max(blocks_for(capacity, block_size), batch * per)
    pools = StatePools(cfg, slots=batch, blocks=blocks, block_size=block_size)
    table = torch.arange(batch * per, dtype=torch.int32).view(batch, per)
    i32 = torch.int32

    def step(tokens: int, past: int) -> dict:
        return {"input_ids": torch.randint(0, cfg.vocab_size, (batch * tokens,)),
                "cu_seqlens": torch.arange(batch + 1, dtype=i32) * tokens,
                "past_lens": torch.full((batch,), past, dtype=i32), "slots": torch.arange(batch, dtype=i32),
                "block_table": table[:, : blocks_for(past + tokens, block_size)].contiguous(),
                "logits_index": torch.arange(1, batch + 1) * tokens - 1, **pools.tensors}

    feeds = step(positions, 0)
    pools.write_back(feeds, runner.infer(feeds))

    def one() -> float:
        feeds = step(1, positions)
        t = time.perf_counter()
        runner.infer(feeds)
        return time.perf_counter() - t
    return one


def medians_ms(steps: dict, repeats: int) -> dict[str, float]:
    """Median ms of each step function, the steps interleaved (machine noise hits them alike)."""
    times: dict[str, list[float]] = {k: [] for k in steps}
    names = list(steps)
    for i in range(repeats):
        for k in names[i % len(names):] + names[: i % len(names)]:  # each case first in turn
            times[k].append(steps[k]())
    return {k: statistics.median(v) * 1e3 for k, v in times.items()}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="k3-mini")
    p.add_argument("--large", type=int, default=1 << 20)
    p.add_argument("--small", type=int, default=4096)
    p.add_argument("--positions", type=int, default=64)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--threads", type=int, default=0, help="ONNX Runtime intra-op threads (0: its default)")
    p.add_argument("--json", type=Path)
    a = p.parse_args(argv)
    from k3x.export.options import ExportOptions, Target
    from k3x.export.pipeline import export
    from k3x.model import preset
    from k3x.runtime.runners import RunnerOptions
    from k3x.runtime.serve import serving_runner

    cfg = preset(a.preset)
    with tempfile.TemporaryDirectory() as tmp:
        export(ExportOptions((Target.ONNX,), Path(tmp) / "x", preset=a.preset, serving=True, block_size=a.block_size))
        runner = serving_runner("ort", Path(tmp) / "x", RunnerOptions(intra_op_threads=a.threads))
        kw = {"positions": a.positions, "block_size": a.block_size}
        ms = medians_ms({"small": decode_step(runner, cfg, batch=1, capacity=a.small, **kw),
                         "large": decode_step(runner, cfg, batch=1, capacity=a.large, **kw),
                         "many": decode_step(runner, cfg, batch=a.batch, capacity=a.small, **kw)}, a.repeats)
        small, large, many = ms["small"], ms["large"], ms["many"]
    r = {"preset": a.preset, "positions": a.positions, "small_pool": a.small, "large_pool": a.large,
         "decode_ms_small_pool": small, "decode_ms_large_pool": large, "capacity_ratio": large / small,
         "batch": a.batch, "tokens_per_s_1": 1e3 / small, f"tokens_per_s_{a.batch}": a.batch * 1e3 / many,
         "batching_speedup": a.batch * small / many}
    print(f"{a.preset}, ORT CPU, one decode step at {a.positions} positions:\n"
          f"  pool for {a.small:>9,} positions: {small:8.2f} ms\n  pool for {a.large:>9,} positions: {large:8.2f} ms"
          f"   ratio {large / small:.2f}\n  {a.batch} sequences together: {many:8.2f} ms/step -> "
          f"{r[f'tokens_per_s_{a.batch}']:.0f} tokens/s vs {r['tokens_per_s_1']:.0f} alone "
          f"({r['batching_speedup']:.1f}x)")
    if a.json:
        a.json.write_text(json.dumps(r, indent=1) + "\n")
    return r


if __name__ == "__main__":
    main()
