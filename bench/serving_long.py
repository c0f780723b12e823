"""A long prompt served end to end, its memory against the pool prediction ("long context").

`--preset` (default k3-mini) with its context raised to the prompt (+ new tokens) is saved as a checkpoint
(random weights, seed 0) and exported with `--serving` for `--target` (pt2, the default: the step program in
this process, whose k3::mla_paged runs key-blocked on CPU; or ort: the ort flavor) into a temp folder (or
`--export DIR`, a serving export whose context is long enough). One prompt of --prompt random tokens (default
131,072) then goes through the serving runtime (runtime/serve.py `serve`: scheduler, chunked prefill of --chunk
tokens per step, state pools written back in place; ORT with IO binding) and decodes --new-tokens tokens.

Memory, from the process's resident set (/proc/self/status; ORT's arena is off, so freed step memory goes back):
  - baseline: after the session is loaded and one short request has run (warm-up), before the pools exist;
  - steady: the highest RSS seen between steps (step temporaries freed) minus the baseline: what stays while
    the sequence lives = its pools, all pages written by the end of the prompt;
  - peak: the high-water mark (VmHWM, reset at the baseline) minus the baseline = pools + the largest step's
    temporaries (a prefill chunk's; bounded by the chunk, not the context, since k3::mla_paged works in key
    blocks), reported apart.
The prediction is what `k3x inspect --checkpoint CKPT --context N --sequences 1 --dtype fp32 --chunk T` prints:
model/state.py `pool_bytes` for one sequence of the served positions in the export's dtype (against steady)
and that plus model/working.py `step_working_bytes` of a --chunk step (against peak). Goal: within 10%.

--tail runs only the prompt's last chunk and the decode, on pools holding (random) state for every earlier
position: the memory at the full context in minutes, where the whole prefill takes hours on a small CPU.

    python -m k3x.bench.serving_long [--target pt2|ort] [--preset k3-mini] [--prompt 131072] [--chunk 512]
                                     [--new-tokens 4] [--tail]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import statistics
import tempfile
import time
from pathlib import Path
from typing import Iterator

from k3x.bench.serving_steps import open_serving, write_json


def status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def libc_malloc():
    """glibc's allocator: large blocks always mmapped (returned to the system when freed, not kept in the heap
    by the dynamic threshold) and `trim` handing back freed heap pages, so the RSS between steps is what is
    live. None where there is no glibc."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"))
        libc.mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD: fixed at 1 MiB (also turns the dynamic threshold off)
        return libc
    except (OSError, AttributeError):
        return None


def reset_peak() -> None:
    """VmHWM := VmRSS (Linux: 5 > /proc/PID/clear_refs)."""
    Path("/proc/self/clear_refs").write_text("5")


@contextlib.contextmanager
def long_export(a: argparse.Namespace) -> Iterator[Path]:
    if a.export is not None:
        yield a.export
        return
    from k3x.checkpoint.save import save_checkpoint
    from k3x.exporter.options import ExportOptions, Target
    from k3x.exporter.pipeline import export
    from k3x.model import build_model, preset

    cfg = preset(a.preset)
    cfg = dataclasses.replace(cfg, max_position_embeddings=max(cfg.max_position_embeddings,
                                                               a.prompt + a.new_tokens))
    with tempfile.TemporaryDirectory(prefix="k3x-long-") as tmp:
        save_checkpoint(build_model(cfg, seed=0), Path(tmp) / "ckpt", expert_format="dense")
        export(ExportOptions((Target(a.target if a.target == "pt2" else "onnx"),), Path(tmp) / "x",
                             checkpoint=Path(tmp) / "ckpt", serving=True, block_size=a.block_size))
        yield Path(tmp) / "x"


class Watched:
    """The runner, with the resident set recorded after every step (KiB) and the steps timed."""

    def __init__(self, runner, libc) -> None:
        self.runner, self.device, self.libc = runner, getattr(runner, "device", "cpu"), libc
        self.rss: list[int] = []
        self.seconds: list[float] = []

    def infer(self, feeds):
        t = time.perf_counter()
        out = self.runner.infer(feeds)
        self.seconds.append(time.perf_counter() - t)
        if self.libc is not None:
            self.libc.malloc_trim(0)
        self.rss.append(status_kib("VmRSS"))
        return out


def measure(path: Path, a: argparse.Namespace) -> dict:
    import torch

    from k3x.runtime.serve import ServeOptions, serve
    from k3x.text.sampling import SamplingOptions

    libc = libc_malloc()
    runner, cfg, bs = open_serving(path, a.threads, backend=a.target)
    options = ServeOptions(max_sequences=1, block_size=bs, max_step_tokens=a.chunk)
    greedy = SamplingOptions(max_new_tokens=a.new_tokens, temperature=0.0)
    serve(runner, cfg, [[1] * min(a.chunk, 64)], greedy, options)  # warm-up: lazy allocations of the session
    prompt = torch.randint(0, cfg.vocab_size, (a.prompt,), generator=torch.Generator().manual_seed(0)).tolist()
    if libc is not None:
        libc.malloc_trim(0)
    base = status_kib("VmRSS")
    reset_peak()
    watched = Watched(runner, libc)
    t = time.perf_counter()
    record = serve(watched, cfg, [prompt], greedy, options)[0]
    seconds = time.perf_counter() - t
    peak = status_kib("VmHWM")
    positions = a.prompt + a.new_tokens - 1
    prefill_steps = -(-a.prompt // a.chunk)
    return {"preset": cfg.name, "target": a.target, "threads": a.threads, "prompt": a.prompt, "chunk": a.chunk,
            "new_tokens": len(record.tokens), "positions": positions, "steps": len(watched.seconds),
            "seconds": seconds, "prefill_tokens_per_s": a.prompt / sum(watched.seconds[:prefill_steps]),
            "decode_ms": 1e3 * sum(watched.seconds[prefill_steps:]) / max(1, len(watched.seconds) - prefill_steps),
            **memory(cfg, positions, bs, a.chunk, base, peak, watched.rss)}


def memory(cfg, positions: int, block_size: int, chunk: int, base: int, peak: int, rss: list[int]) -> dict:
    """The run's memory (RSS in KiB: baseline, VmHWM, after each step) against what `k3x inspect --chunk`
    predicts: pools (model/state.py pool_bytes) and a step's working memory (model/working.py)."""
    import torch

    from k3x.model.state import pool_bytes
    from k3x.model.working import step_working_bytes

    pools = pool_bytes(cfg, positions, 1, block_size, dtype=torch.float32)["total_bytes"]
    working = step_working_bytes(cfg, chunk, block_size, torch.float32)["total_bytes"]
    steady, top = (max(rss) - base) * 1024, (peak - base) * 1024
    return {"baseline_bytes": base * 1024, "predicted_pool_bytes": pools, "predicted_step_bytes": working,
            "steady_bytes": steady, "steady_over_predicted": steady / pools,
            "peak_bytes": top, "peak_step_temporaries_bytes": top - steady,
            "peak_over_predicted": top / (pools + working),
            "inspect": f"k3x inspect --checkpoint CKPT --context {positions} --sequences 1 --dtype fp32 "
                       f"--chunk {chunk}"}


def measure_tail(path: Path, a: argparse.Namespace) -> dict:
    """--tail: the end of the long prompt only. The pools hold random state for every position before the
    last chunk (as a full prefill would leave them: every page written), then the last --chunk tokens of the
    prompt as one step and the decode steps, each written back in place (runtime/pools.py): the steady and
    peak memory at the full context without the hours of the whole prefill on a small CPU."""
    from k3x.bench.serving_steps import StepCase

    libc = libc_malloc()
    runner, cfg, bs = open_serving(path, a.threads, backend=a.target)
    positions = a.prompt + a.new_tokens - 1
    warm = StepCase(cfg, batch=1, positions=a.chunk, capacity=a.chunk, block_size=bs)
    runner.infer(warm.feeds(a.chunk, 0))
    del warm
    if libc is not None:
        libc.malloc_trim(0)
    base = status_kib("VmRSS")
    reset_peak()
    case = StepCase(cfg, batch=1, positions=positions, capacity=positions, block_size=bs)
    watched = Watched(runner, libc)
    steps = [(a.chunk, a.prompt - a.chunk)] + [(1, a.prompt + i) for i in range(a.new_tokens - 1)]
    for tokens, past in steps:
        feeds = case.feeds(tokens, past)
        case.pools.write_back(feeds, watched.infer(feeds))
    peak = status_kib("VmHWM")
    return {"preset": cfg.name, "target": a.target, "threads": a.threads, "prompt": a.prompt, "chunk": a.chunk,
            "tail": True, "new_tokens": a.new_tokens, "positions": positions, "steps": len(steps),
            "seconds": sum(watched.seconds), "prefill_tokens_per_s": a.chunk / watched.seconds[0],
            "decode_ms": 1e3 * statistics.median(watched.seconds[1:] or [float("nan")]),
            **memory(cfg, positions, bs, a.chunk, base, peak, watched.rss)}


def table(r: dict) -> str:
    mib = 2 ** 20
    rows = [("served: prompt + decoded tokens", f"{r['prompt']:,} + {r['new_tokens']} in {r['steps']} steps"),
            ("wall time (s)", f"{r['seconds']:.1f}"),
            ("prefill tokens/s (chunks of {:,}{})".format(r["chunk"], ", last only" if r.get("tail") else ""),
             f"{r['prefill_tokens_per_s']:.1f}"),
            ("decode ms/token at the end", f"{r['decode_ms']:.1f}"),
            ("process baseline RSS (MiB)", f"{r['baseline_bytes'] / mib:.1f}"),
            ("pools predicted (MiB, pool_bytes = inspect)", f"{r['predicted_pool_bytes'] / mib:.1f}"),
            ("steady RSS over baseline (MiB)", f"{r['steady_bytes'] / mib:.1f}"),
            ("steady / predicted (goal within 10%)", f"{r['steady_over_predicted']:.3f}"),
            ("peak RSS over baseline (MiB)", f"{r['peak_bytes'] / mib:.1f}"),
            ("  of which the largest step's temporaries", f"{r['peak_step_temporaries_bytes'] / mib:.1f}"),
            ("step working memory predicted (MiB, inspect)", f"{r['predicted_step_bytes'] / mib:.1f}"),
            ("peak / (pools + step) predicted (goal 10%)", f"{r['peak_over_predicted']:.3f}")]
    how = ("its last chunk and the decode on pools as the prefill leaves them (--tail)" if r.get("tail")
           else "through serve()")
    head = f"{r['preset']} (context raised), {r['target']} CPU, {r['threads']} threads, one long prompt, {how}:"
    return "\n".join([head] + [f"  {k:<46} {v:>22}" for k, v in rows])


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="k3-mini")
    p.add_argument("--export", type=Path, help="an existing serving export (ort flavor, context long enough)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--prompt", type=int, default=131072)
    p.add_argument("--chunk", type=int, default=512, help="tokens per step (the prefill's chunks)")
    p.add_argument("--new-tokens", type=int, default=4)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--target", choices=("pt2", "ort"), default="pt2", help="the serving runner (and export flavor)")
    p.add_argument("--tail", action="store_true", help="only the last chunk and the decode (see measure_tail)")
    p.add_argument("--json", type=Path)
    a = p.parse_args(argv)
    with long_export(a) as path:
        r = (measure_tail if a.tail else measure)(path, a)
    print(table(r))
    write_json(a.json, r)
    return r


if __name__ == "__main__":
    main()
