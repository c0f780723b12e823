"""gpu_check section `kda_state_configs`: every entry of the KDA chunked state kernel's launch table
(`STATE_RESOURCES_SM90`: BV, warps, stages) at K3's prefill shape, so the table's choice can follow measurements
on the machine rather than the cost model alone.

1. Each entry is checked in its own process against the fp64 reference (K = 128 and 64), launches blocking: a
   bad entry can fault and poison a CUDA context for good (on the first H200 run, with Triton 3.6, three
   single-stage BV 16/32 entries did, or gave wrong values). Processes run a few at a time.
2. The entries that ran right are timed in this process at B=1, T=4096, H=96, bf16 (the anchor's shape),
   beside the entry the launch configuration picks (`kda_chunk_launch_config`).

    python bench/gpu_check_kda_configs.py --probe BV WARPS STAGES [--K 128 --H 96 --T 1281 --device cuda]

runs one entry's check and prints `PROBE ok|wrong ...`; the CPU test runs it under TRITON_INTERPRET=1 at tiny
fp32 shapes."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent
PARALLEL = 8  # probe processes at once (compiling is CPU-bound; the checks are short)


def force(kt, key: tuple[int, int, int]) -> None:
    """Make the launch configuration pick `key` for the state kernel (a probe process's own copy)."""
    kt._pick_state = lambda B, H, V: key  # noqa: SLF001 - the probe pins one table entry


def probe(key: tuple[int, int, int], K: int, H: int, T: int, device: str) -> str:
    """One entry's check against the fp64 reference: 'ok', 'wrong (rmse ...)' or 'fault: <last line>'."""
    cmd = [sys.executable, str(Path(__file__)), "--probe", *map(str, key), "--K", str(K), "--H", str(H), "--T", str(T),
           "--device", device]
    env = {**os.environ, "CUDA_LAUNCH_BLOCKING": "1"}
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=150, env=env)
    except subprocess.TimeoutExpired:
        return "fault: timed out"
    for line in proc.stdout.splitlines():
        if line.startswith("PROBE "):
            return line[len("PROBE "):]
    lines = [x for x in (proc.stdout + proc.stderr).splitlines() if x.strip()]
    return "fault: " + (lines[-1] if lines else f"exit {proc.returncode}")


def kda_state_configs(ctx) -> list:
    gc = sys.modules[type(ctx).__module__]  # bench/gpu_check.py, run as __main__ or imported
    if ctx.device != "cuda" or not ctx.bench:
        return [gc.Result("kda state configs", "info", None, note="needs CUDA and the benchmarks")]
    import torch

    from k3x.custom_ops.kda import triton as kt

    keys = sorted(kt.STATE_RESOURCES_SM90)
    cases = [(key, K) for K in ((128,) if ctx.quick else (128, 64)) for key in keys]
    with ThreadPoolExecutor(PARALLEL) as pool:
        verdicts = dict(zip(cases, pool.map(lambda c: probe(c[0], c[1], 96, 1281, "cuda"), cases)))
    out = [gc.Result(f"kda state config BV{key[0]}-w{key[1]}-s{key[2]} K{K}", "info", None,
                     {"verdict": verdict, "choosable": kt.state_config_runs_right(key)})
           for (key, K), verdict in verdicts.items()]
    right = [key for key in keys if all(v == "ok" for (k, _), v in verdicts.items() if k == key)]
    picked = kt.kda_chunk_launch_config(1, 4096, 96, 128, 128)["state"]
    picked = (picked["BV"], picked["num_warps"], picked["num_stages"])
    q, k, v, g, beta, h0 = gc._kda_inputs(1, 4096, 96, 128, 128, torch.bfloat16, "cuda")
    pick_state = kt._pick_state  # noqa: SLF001 - restored below
    try:
        for key in right:
            if ctx.time_left() < 5:
                out.append(gc.Result("kda state config timing", "info", None, note="skipped: section budget"))
                break
            force(kt, key)
            ms = gc._bench(lambda: kt.kda_chunked(q, k, v, g, beta, initial_state=h0, gate_lower_bound=-5.0), ctx)
            out.append(gc.Result(f"kda prefill B1-T4096-H96 state BV{key[0]}-w{key[1]}-s{key[2]}", "bench", None,
                                 {"ms": ms, "picked": key == picked}))
    finally:
        kt._pick_state = pick_state  # noqa: SLF001
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="one KDA state-kernel launch entry against the fp64 reference")
    p.add_argument("--probe", nargs=3, type=int, metavar=("BV", "WARPS", "STAGES"), required=True)
    p.add_argument("--K", type=int, default=128)
    p.add_argument("--H", type=int, default=96)
    p.add_argument("--T", type=int, default=1281)
    p.add_argument("--device", default="cuda")
    a = p.parse_args(argv)
    sys.path.insert(0, str(HERE))
    import gpu_check as gc

    gc._make_k3x_importable()
    import torch

    from k3x.custom_ops.kda import reference as ref, triton as kt

    force(kt, tuple(a.probe))
    dtype = torch.bfloat16 if a.device == "cuda" else torch.float32  # the interpreter is fp32-only
    q, k, v, g, beta, h0 = gc._kda_inputs(1, a.T, a.H, a.K, a.K, dtype, a.device)
    o, s = kt.kda_chunked(q, k, v, g, beta, initial_state=h0, gate_lower_bound=-5.0)
    ro, rs = ref.kda_chunked(*(x.double() for x in (q, k, v, g, beta)), initial_state=h0.double())
    got = [gc._compare(n, x, e, dtype) for n, x, e in (("o", o, ro), ("state", s, rs))]
    verdict = "ok" if all(r.ok for r in got) else "wrong"
    print("PROBE", verdict if verdict == "ok" else
          f"{verdict} (rmse ratio o {got[0].metrics['rmse_ratio']:.3g}, state {got[1].metrics['rmse_ratio']:.3g})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
