"""The one prepared script for a GPU machine: kernel parity in bf16 and benchmarks against the anchors.

    python bench/gpu_check.py                 # on CUDA: parity + benchmarks, < 8 min; JSON to $OUT/gpu_check.json
    python bench/gpu_check.py --quick         # fewer shapes and shorter timings: < 5 min
    python bench/gpu_check.py --parity-only   # skip the benchmarks
    python bench/gpu_check.py --only tune --budget 540 [--tune-from TABLE]   # the dispatch table, resumable
    TRITON_INTERPRET=1 python bench/gpu_check.py --cpu-selftest   # same parity code path, tiny fp32 shapes, CPU

Always reports: the JSON is rewritten (atomically) before and after every section, with the section in
progress named, so a run stopped by the device's time limit returns everything measured until then; a section
that leaves the device unusable hands the rest to a fresh process (gpu_check_restart.py). Each
section has its own time budget (`BUDGETS_S`, scaled down by --quick) inside the run's total (`--budget`);
a section checks it between cases and reports what it skipped. The import path needs only torch, triton
and this repository (the GPU machine has torch 2.11 + triton 3.6 + fla, no onnx, no TensorRT, no network):
tests/bench/test_gpu_check_imports.py runs every section's imports where onnx/onnxruntime/tensorrt fail.
fla's autotuners are cut to a few configs (`limit_fla_autotune`: a fresh machine would autotune ~75 per
kernel and shape). Decode figures are device time: a CUDA graph of many launches timed with events.

Parity: every Triton kernel on bf16 inputs vs the eager references run on the same inputs upcast.  The
KDA and AttnRes references compute in fp64 when given fp64 inputs: that is their oracle.  The MoE oracle
is the fp32 reference (same routing decisions as the kernel), run on the GPU with TF32 disabled.  Tolerances come from
the one table in k3x/runtime/tolerances.py.  fla's own bf16 error against the same oracle is reported when
fla-core is installed (it travels as a wheel and may be absent: those rows are skipped with a note).

Benchmarks (`triton.testing.do_bench`, warm-up 50 ms, 300 ms of repeats): copy and GEMM ceilings, KDA
prefill (H=64, 96; T=4096, 32768) and decode (B=1, 64) vs fla, AttnRes vs copy, MoE expert GEMMs vs
`torch._grouped_mm` at K3's expert shape, W4A8 experts (bench/gpu_check_w4a8.py) beside W4A16 and grouped_mm.
Tune (`--only tune`, bench/gpu_check_tune.py): every dispatch candidate of every op checked, then timed at
K3's shapes; the winners' table to $OUT/tuned/<GPU kind>.json (the form custom_ops/dispatch.py reads).

`CHECKS`: the check functions run in order, each `fn(Context) -> list[Result]` (add one with `@check`).
Exit status is 1 if any parity result fails or any check raises.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

from gpu_check_restart import DeviceLost, continuation, device_alive  # noqa: E402 (bench/)
from gpu_check_timing import (  # noqa: E402,F401 (bench/; sections call gc._bench, gc.device_time)
    FLA_AUTOTUNE_CONFIGS, bench_ms as _bench, device_time, device_time_within, limit_fla_autotune)

ROOT = Path(__file__).resolve().parents[1]


# seconds per section (a section stops starting new cases once its budget is spent); --quick scales by QUICK
BUDGETS_S = {"parity_kda": 45, "parity_attn_res": 20, "parity_moe": 45, "parity_moe_w4a8": 20, "bench_ceilings": 15,
             "bench_kda": 75, "bench_attn_res": 15, "bench_moe": 45, "bench_moe_w4a8": 40, "bench_decode_graph": 90,
             "plugin_aot_kernels": 50, "parity_model_end_to_end": 30, "parity_serving": 40, "bench_serving": 45,
             "serving_end_to_end": 90, "kda_state_configs": 90, "tune": 480}
# a device lease is 15 minutes, a command at most 10: a whole run plus the machine's start leaves room to rerun
DEFAULT_BUDGET_S, QUICK_BUDGET_S, QUICK = 480.0, 300.0, 0.6


@dataclass
class Context:
    device: str  # "cuda", or "cpu" for the self-test (Triton interpreter)
    dtype: object  # torch dtype of kernel inputs: bf16 on CUDA, fp32 in the self-test
    selftest: bool
    bench: bool
    quick: bool = False
    budget_s: float = DEFAULT_BUDGET_S  # the whole run
    copy_tbps: float | None = None  # measured copy ceiling, set by bench_ceilings
    tune_from: Path | None = None  # a cut tune run's table: the tune section resumes from it
    t0: float = field(default_factory=time.perf_counter)
    deadline: float = float("inf")  # of the running section (perf_counter time)

    def total_left(self) -> float:
        return self.budget_s - (time.perf_counter() - self.t0)

    def time_left(self) -> float:
        """Seconds left to the running section: its own budget, within the run's."""
        return min(self.deadline - time.perf_counter(), self.total_left())

    def start_section(self, name: str) -> None:
        budget = BUDGETS_S.get(name, 30.0) * (QUICK if self.quick else 1.0)
        self.deadline = time.perf_counter() + max(0.0, min(budget, self.total_left()))


@dataclass
class Result:
    name: str
    kind: str  # "parity" | "bench" | "info"
    ok: bool | None  # None: informational
    metrics: dict = field(default_factory=dict)
    note: str = ""


CHECKS: list[Callable[[Context], list[Result]]] = []  # the extension point: run in order by main()


def check(fn: Callable[[Context], list[Result]]) -> Callable[[Context], list[Result]]:
    CHECKS.append(fn)
    return fn


# ------------------------------------------------------------------------------------------------ helpers


def _compare(name: str, actual, expected, dtype, extra: dict | None = None) -> Result:
    """Max-abs, RMSE ratio and the dtype tolerance of runtime/tolerances.py (allclose semantics)."""
    import torch

    from k3x.runtime.tolerances import TOLERANCES

    a, e = actual.double().cpu(), expected.double().cpu()
    atol, rtol = TOLERANCES[dtype]
    finite = bool(torch.isfinite(a).all())
    err = (a - e).abs()
    metrics = {"max_abs": err.max().item(), "rmse_ratio": (err.pow(2).mean().sqrt() / (e.pow(2).mean().sqrt() + 1e-12)).item(),
               "worst_excess": (err - atol - rtol * e.abs()).max().item(), "shape": list(a.shape)}
    metrics.update(extra or {})
    ok = finite and a.shape == e.shape and metrics["worst_excess"] <= 0
    return Result(name, "parity", ok, metrics, "" if finite else "non-finite values")


def _fla():
    try:
        from fla.ops.kda import chunk_kda, fused_recurrent_kda
    except Exception as exc:  # absent wheel or incompatible build: skip with a note
        return None, f"fla-core unavailable ({type(exc).__name__}: {exc})"
    limit_fla_autotune()
    return (chunk_kda, fused_recurrent_kda), f"fla autotune limited to {FLA_AUTOTUNE_CONFIGS} configs per kernel"


def _kda_inputs(B, T, H, K, V, dtype, device, gate_min=-5.0):
    import torch

    from k3x.custom_ops.kda.reference import l2norm

    q = l2norm(torch.randn(B, T, H, K, device=device)).to(dtype)
    k = l2norm(torch.randn(B, T, H, K, device=device)).to(dtype)
    v = torch.randn(B, T, H, V, device=device).to(dtype)
    g = torch.rand(B, T, H, K, device=device) * gate_min  # fp32 log-decay
    beta = torch.rand(B, T, H, device=device).to(dtype)
    h0 = torch.randn(B, H, K, V, device=device) * 0.1
    return q, k, v, g, beta, h0


def _decode_inputs(B, H, K, V, dtype, device):
    """k3::kda_decode's inputs (W = 4, pools of B + 3 slots, slots reversed): qkv ... slots."""
    import torch

    C, r = 2 * H * K + H * V, lambda *s, a=1.0: torch.randn(*s, device=device) * a  # noqa: E731
    return (r(B, C).to(dtype), r(B, H, K).to(dtype), r(B, H).to(dtype), r(B, H, V).to(dtype), r(C, 4, a=0.5).to(dtype),
            r(H, a=0.5), r(H * K), 1 + r(V, a=0.1), r(B + 3, C, 3), r(B + 3, H, K, V, a=0.3),
            torch.arange(B + 2, 2, -1, device=device, dtype=torch.int32) - 1)


# ------------------------------------------------------------------------------------------------ parity


@check
def parity_kda(ctx: Context) -> list[Result]:
    from k3x.custom_ops.kda import reference as ref
    from k3x.custom_ops.kda import triton as kern

    fla, note = _fla() if not ctx.selftest else (None, "self-test")
    shapes = ([(1, 70, 2, 16, 32, -5.0), (1, 40, 1, 16, 16, -20.0)] if ctx.selftest
              else [(2, 1000, 8, 128, 128, -5.0), (1, 300, 4, 64, 128, -20.0), (1, 4096, 2, 128, 128, -5.0)])
    out = []
    for B, T, H, K, V, gmin in shapes:
        if ctx.time_left() < 5:
            out.append(Result("kda_chunked parity", "info", None, note=f"skipped from B{B}-T{T}: section budget"))
            break
        q, k, v, g, beta, h0 = _kda_inputs(B, T, H, K, V, ctx.dtype, ctx.device, gmin)
        ro, rs = ref.kda_chunked(*(x.double() for x in (q, k, v, g, beta)), initial_state=h0.double())
        o, s = kern.kda_chunked(q, k, v, g, beta, initial_state=h0, gate_lower_bound=gmin if gmin >= -5 else None)
        extra = {}
        if fla is not None and gmin >= -5:
            fo, _ = fla[0](q, k, v, g, beta, initial_state=h0, output_final_state=True, safe_gate=True,
                           lower_bound=-5.0)
            extra["fla_max_abs"] = (fo.float() - ro).abs().max().item()
        tag = f"B{B}-T{T}-H{H}-K{K}-V{V}-g{gmin:g}"
        out.append(_compare(f"kda_chunked o {tag}", o, ro, ctx.dtype, extra))
        out.append(_compare(f"kda_chunked state {tag}", s, rs, ctx.dtype))
    for B, T in ([(2, 1), (1, 5)] if ctx.selftest else [(4, 1), (64, 1), (1, 16)]):
        H, K, V = (3, 16, 32) if ctx.selftest else (96, 128, 128)
        q, k, v, g, beta, h0 = _kda_inputs(B, T, H, K, V, ctx.dtype, ctx.device)
        ro, rs = ref.kda_recurrent(*(x.double() for x in (q, k, v, g, beta)), initial_state=h0.double())
        state = h0.clone()
        o = kern.kda_recurrent_(q, k, v, g, beta, state)
        out.append(_compare(f"kda_recurrent_ o B{B}-T{T}-H{H}", o, ro, ctx.dtype))
        out.append(_compare(f"kda_recurrent_ state B{B}-T{T}-H{H}", state, rs, ctx.dtype))
    from k3x.custom_ops.kda_decode import reference as dref, triton as dkern

    for B in ((1, 3) if ctx.selftest else (1, 64)):
        H, K = (2, 16) if ctx.selftest else (96, 128)
        a = _decode_inputs(B, H, K, K, ctx.dtype, ctx.device)
        ro, rc, rs = dref.kda_decode(*(x.float() for x in a[:10]), a[10], scale=K ** -0.5, eps=1e-5,
                                     gate_lower_bound=-5.0)
        o, c, s = dkern.kda_decode(*a, scale=K ** -0.5, eps=1e-5, gate_lower_bound=-5.0)
        for name, x, e in (("o", o, ro), ("conv", c, rc), ("state", s, rs)):
            out.append(_compare(f"kda_decode (fused) {name} B{B}-H{H}", x, e, ctx.dtype))
    if note and not ctx.selftest:
        out.append(Result("fla comparison", "info", None, note=note))
    return out


@check
def parity_attn_res(ctx: Context) -> list[Result]:
    import torch

    from k3x.custom_ops.attn_res import reference as ref
    from k3x.custom_ops.attn_res import triton as kern

    out = []
    for R, N, d in ([(3, 2, 100), (2, 9, 40)] if ctx.selftest else [(256, 8, 7168), (512, 1, 7168), (64, 5, 1000)]):
        prefix = (torch.randn(R, d, device=ctx.device) * 4).to(ctx.dtype)
        bank = torch.randn(R, N, d, device=ctx.device).to(ctx.dtype)
        nw, pw = 1 + 0.1 * torch.randn(d, device=ctx.device), torch.randn(d, device=ctx.device) * 0.05
        out.append(_compare(f"attn_res R{R}-N{N}-d{d}", kern.attn_res(prefix, bank, nw, pw, 1e-5),
                            ref.attn_res(prefix.double(), bank, nw, pw, 1e-5), ctx.dtype))
    return out


@check
def parity_moe(ctx: Context) -> list[Result]:
    import torch

    from k3x.custom_ops.moe import reference as ref
    from k3x.custom_ops.moe import triton as kern

    out = []
    cases = ([(9, 24, 40, 24, 6, 2, None), (9, 24, 20, 36, 5, 1, 2)] if ctx.selftest
             else [(512, 512, 384, 256, 64, 8, None), (256, 512, 384, 256, 64, 8, 5), (16, 7168, 512, 384, 896, 16, None)])
    for N, d, L, I, E, k, hot in cases:
        dev = ctx.device
        x = torch.randn(N, d, device=dev).to(ctx.dtype)
        z = torch.randn(N, L, device=dev).to(ctx.dtype)
        gw = (torch.randn(E, d, device=dev) * d ** -0.5).to(ctx.dtype)
        gb = torch.randn(E, device=dev) * 0.1
        if hot is not None:
            gb[hot] = 100.0
        w1, w3 = ((torch.randn(E, I, L, device=dev) * L ** -0.5).to(ctx.dtype) for _ in range(2))
        w2 = (torch.randn(E, L, I, device=dev) * I ** -0.5).to(ctx.dtype)
        args = (x, z, gw, gb, w1, w3, w2, k, 1.0, True, "situ", 4.0, 25.0)
        tag = f"N{N}-L{L}-I{I}-E{E}-k{k}" + ("" if hot is None else f"-hot{hot}")
        out.append(_compare(f"moe u {tag}", kern.moe(*args), ref.moe(*args), ctx.dtype))
    return out


def _after(section: str, fn) -> None:
    CHECKS.insert([f.__name__ for f in CHECKS].index(section) + 1, fn)


W4A8 = __import__("gpu_check_w4a8")  # MXFP4 experts x MXFP8 activations: parity, then timing after bench_moe
SERVING = __import__("gpu_check_serving")  # the serving step's packed / paged kernels
MODELS = __import__("gpu_check_models")  # end to end: the model through its ops, continuous batching
CHECKS.extend((W4A8.parity_moe_w4a8, SERVING.parity_serving, MODELS.parity_model_end_to_end,
               MODELS.serving_end_to_end,  # correctness first: the benchmarks can outlast the run's budget
               __import__("gpu_check_plugins").plugin_aot_kernels))  # TensorRT plugins' AOT cubins via libcuda
CHECKS.extend(__import__("gpu_check_bench").BENCHMARKS)  # kernel benchmarks against the anchors
_after("bench_kda", __import__("gpu_check_kda_configs").kda_state_configs)  # the state kernel's table, measured
_after("bench_moe", W4A8.bench_moe_w4a8)
_after("bench_moe_w4a8", SERVING.bench_serving)


CHECKS.append(__import__("gpu_check_tune").tune)  # last: `--only tune` spends a lease on the dispatch table


# ------------------------------------------------------------------------------------------------ main


def _make_k3x_importable() -> None:
    """`import k3x` from a plain checkout (the GPU machine has no install): a temporary k3x -> repo link."""
    try:
        import k3x  # noqa: F401
        return
    except ImportError:
        import tempfile

        link_dir = Path(tempfile.mkdtemp(prefix="k3x-path-"))
        (link_dir / "k3x").symlink_to(ROOT, target_is_directory=True)
        sys.path.insert(0, str(link_dir))


def write_report(path: Path, ctx: Context, env: dict, results: list[Result], running: str | None = None,
                 complete: bool = False) -> dict:
    """The JSON report so far, written under a temporary name and renamed (never half a file)."""
    failed = [r for r in results if r.ok is False]
    report = {"env": env, "selftest": ctx.selftest, "quick": ctx.quick, "seconds": time.perf_counter() - ctx.t0,
              "complete": complete, "running": running, "failed": len(failed),
              "results": [asdict(r) for r in results]}
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(report, indent=1, default=str))
    os.replace(tmp, path)
    return report


def run(ctx: Context, path: Path | None = None, env: dict | None = None, only: list[str] | None = None,
        results: list[Result] | None = None) -> list[Result]:
    """Every check in order (or those named in `only`, in that order), each inside its time budget, after
    `results` (a previous process's); the report rewritten before and after each. A section that raises and
    leaves the device unusable ends the run with DeviceLost (the report on disk holds everything so far)."""
    results = list(results or [])
    by_name = {fn.__name__: fn for fn in CHECKS}
    todo = [fn.__name__ for fn in CHECKS] if only is None else list(only)
    for i, name in enumerate(todo):
        fn = by_name[name]
        if ctx.total_left() <= 1.0:
            results.append(Result(name, "info", None, note="skipped: the run's time budget is spent"))
            if path is not None:
                write_report(path, ctx, env or {}, results)
            continue
        if path is not None:
            write_report(path, ctx, env or {}, results, running=name)
        ctx.start_section(name)
        t = time.perf_counter()
        try:
            got = fn(ctx)
        except Exception:
            got = [Result(name, "error", False, note=traceback.format_exc(limit=8))]
        results.extend(got)
        results.append(Result(f"{name} time", "info", None, {"s": time.perf_counter() - t}))
        for r in got:
            print(f"{ {True: 'PASS', False: 'FAIL', None: '    '}[r.ok]} {r.kind:6s} {r.name:44s} {_fmt(r.metrics)} "
                  f"{r.note}".rstrip(), flush=True)
        if path is not None:
            write_report(path, ctx, env or {}, results)
        if got and got[0].kind == "error" and not device_alive(ctx):
            raise DeviceLost(name, todo[i + 1:], results)
    return results


def _fmt(m: dict) -> str:
    return " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in m.items())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cpu-selftest", action="store_true", help="tiny fp32 parity on CPU under TRITON_INTERPRET=1")
    p.add_argument("--parity-only", action="store_true", help="skip the benchmarks")
    p.add_argument("--quick", action="store_true", help=f"fewer shapes, shorter timings, {QUICK_BUDGET_S:.0f} s budget")
    p.add_argument("--budget", type=float, default=None, help="seconds for the whole run (default "
                   f"{DEFAULT_BUDGET_S:.0f}, {QUICK_BUDGET_S:.0f} with --quick)")
    p.add_argument("--only", help="comma-separated sections to run, in this order (a rerun of what failed): "
                   + ", ".join(fn.__name__ for fn in CHECKS))
    p.add_argument("--tune-from", type=Path, help="the table of a cut tune run ($OUT/tuned/<GPU>.json): resume it")
    p.add_argument("--continue-from", type=Path, help=argparse.SUPPRESS)  # set when a fresh process takes over
    args = p.parse_args(argv)
    only = None if args.only is None else [n.strip() for n in args.only.split(",") if n.strip()]
    if only is not None and (bad := sorted(set(only) - {fn.__name__ for fn in CHECKS})):
        p.error(f"--only: no section named {', '.join(bad)}")
    if args.cpu_selftest:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton
        if os.environ["TRITON_INTERPRET"] != "1":
            print("--cpu-selftest needs TRITON_INTERPRET=1", file=sys.stderr)
            return 2
    _make_k3x_importable()
    import torch

    budget = args.budget if args.budget is not None else (QUICK_BUDGET_S if args.quick else DEFAULT_BUDGET_S)
    common = {"quick": args.quick, "budget_s": budget, "tune_from": args.tune_from}
    if args.cpu_selftest:
        ctx = Context("cpu", torch.float32, selftest=True, bench=False, **common)
    elif torch.cuda.is_available():
        torch.backends.cuda.matmul.allow_tf32 = False  # fp32 oracle
        torch.backends.cudnn.allow_tf32 = False
        ctx = Context("cuda", torch.bfloat16, selftest=False, bench=not args.parity_only, **common)
    else:
        print("no CUDA device: run with --cpu-selftest (and TRITON_INTERPRET=1) on CPU", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    import triton

    env = {"torch": torch.__version__, "triton": triton.__version__,
           "device": torch.cuda.get_device_name() if ctx.device == "cuda" else "cpu (interpreter)"}
    out_dir = Path(os.environ.get("OUT", "./out"))
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "gpu_check.json"
    prior = []
    if args.continue_from is not None:  # a fresh process after a device fault: the report so far comes first
        before = json.loads(args.continue_from.read_text())
        prior, env["continued_after"] = [Result(**r) for r in before["results"]], before["env"]["continued_after"]
    try:
        results = run(ctx, path, env, only, prior)
    except DeviceLost as lost:
        env["continued_after"] = env.get("continued_after", []) + [lost.section]
        write_report(path, ctx, env, lost.results, complete=not lost.remaining)
        if not lost.remaining:
            return 1
        print(f"{lost}: {', '.join(lost.remaining)} run in a fresh process", flush=True)
        os.execv(sys.executable, [sys.executable, str(Path(__file__).resolve()),
                                  *continuation(argv, lost.remaining, ctx.total_left(), path)])
    report = write_report(path, ctx, env, results, complete=True)
    print(f"{len(results)} results, {report['failed']} failed, {report['seconds']:.1f} s -> {path}")
    return 1 if report["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
