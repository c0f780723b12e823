"""Timing helpers of bench/gpu_check.py: do_bench medians, device time of short kernels through a CUDA graph,
and fla's autotuning cut to a few configs. torch and triton only (imported inside the functions)."""

from __future__ import annotations

import sys


def bench_ms(fn, ctx=None) -> float:
    """Median ms of `fn` by `triton.testing.do_bench` (warm-up 50 ms, 300 ms of repeats; 100 ms with --quick)."""
    import triton

    return triton.testing.do_bench(fn, warmup=50, rep=100 if ctx is not None and ctx.quick else 300)


def device_time(fn, launches: int = 200) -> tuple[float, str]:
    """Device ms per call of `fn`: `launches` calls captured in one CUDA graph, replayed, timed with events.
    If capture fails (a callee that syncs or allocates outside the pool), the same number of back-to-back
    calls timed with events (still device time, plus whatever launch gaps the queue does not hide)."""
    import torch

    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    try:
        g = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fn()  # warm-up on the capture stream
            torch.cuda.synchronize()
            with torch.cuda.graph(g, stream=stream):
                for _ in range(launches):
                    fn()
        g.replay()
        torch.cuda.synchronize()
        times = []
        for _ in range(5):
            start.record()
            g.replay()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / launches)
        return sorted(times)[2], "cuda graph"
    except Exception as exc:  # noqa: BLE001 - fall back to plain event timing, say so
        how = f"events (graph capture failed: {type(exc).__name__})"
    torch.cuda.synchronize()
    start.record()
    for _ in range(launches):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / launches, how


def device_time_within(fn, target_ms: float = 25.0, most: int = 200) -> tuple[float, str]:
    """`device_time` with as many launches per graph as fill about `target_ms` (2 .. `most`), from one call timed
    with events: for kernels from microseconds (decode) to tens of milliseconds (prefill) in one section."""
    import torch

    fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    return device_time(fn, max(2, min(most, int(target_ms / max(start.elapsed_time(end), 1e-3)))))


FLA_AUTOTUNE_CONFIGS = 2


def limit_fla_autotune(keep: int = FLA_AUTOTUNE_CONFIGS) -> int:
    """Cut every Triton autotuner in the imported fla.ops modules to `keep` configs, preferring 4 warps and 2
    stages (a heuristic, not a tuned table: fla's figures may lose what full autotuning would find; every fla
    figure carries `fla_autotune_configs`). Autotuners under `@triton.heuristics` are reached through `.fn`.
    Returns the number of autotuners cut."""
    from triton.runtime.autotuner import Autotuner

    cut = 0
    for name, mod in list(sys.modules.items()):
        if not name.startswith("fla.") or mod is None:
            continue
        for obj in list(vars(mod).values()):
            for _ in range(4):  # an autotuner may sit under @triton.heuristics: follow the .fn chain
                if isinstance(obj, Autotuner) and len(obj.configs) > keep:
                    obj.configs = sorted(obj.configs, key=lambda c: (abs(c.num_warps - 4), abs(c.num_stages - 2)))[:keep]
                    cut += 1
                obj = getattr(obj, "fn", None)
    return cut
