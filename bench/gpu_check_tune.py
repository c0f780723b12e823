"""The `tune` section of bench/gpu_check.py: spends a lease on the dispatch table (custom_ops/dispatch.py).

For every dispatched op (`kda.prefill`, `kda.decode`, `kda_packed.step`, `attn_res.mix`, `moe.experts`) every
candidate the op's candidates.py declares is first checked against the reference at a parity shape (K3's head and expert dims: KDA B=1, T=300 /
B=8, T=1 at H=96 against the fp64 reference; MoE 64 tokens over 896 experts, top-16, against the fp32
reference), then the candidates that passed are timed (device time, `gpu_check_timing.device_time_within`) at
K3's shapes: KDA prefill B=1 at T = 4K, 16K, 1K (H=96, K=V=128); decode B = 1, 64, 8, 256; MoE 8192, 1024,
4096, 1, 64, 256 and 16 tokens (E=896, top-16, d=7168, L=3584, I=3072); AttnRes R = 8192 rows over 8 sources
and 1, then 1024, 64, 1 rows over 8 (d=7168; parity R=64 against the fp64 reference); the serving step's KDA
at decode steps of 1, 64, 256 sequences and prefill chunks of 4K, 1K, 16K rows (parity on steps of each kind).
Parity verdicts are kept per op and parity shape. Each shape lands in its op's shape
class; the class's entry lists the passing candidates fastest first, the form `plan.dispatch.read_table` reads.

The table is written to $OUT/tuned/<GPU kind>.json (atomically) after every class, "complete" false until the
last, so a run cut by the lease returns what it measured; `--tune-from TABLE` (or the same file under $OUT,
after gpu_check_restart re-executes the script) resumes: measured classes and parity verdicts are kept, the
rest is done. Each class is also a result row: the candidates' times, the pick, and the anchor measured on an
H200 beside it where there is one (fla, grouped GEMM; the same candidates run here, so the row compares them on
this GPU directly). A candidate whose package is absent is reported and left out; in the CPU self-test
(interpreter, tiny fp32 shapes, times of one call: the flow, not a measurement) so are those that do not
interpret, and one launch entry stands for all of its op's (the interpreter ignores warps and stages).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

# measured on one H200 (torch 2.11, Triton 3.6, fla-core 0.6.0) at these shapes: (what, ms)
ANCHORS = {("kda.prefill", "bf16-tokens<=4096"): ("fla chunk_kda H200", 1.341),
           ("kda.decode", "bf16-rows<=1"): ("fla fused_recurrent H200", 0.0387),
           ("kda.decode", "bf16-rows<=64"): ("fla fused_recurrent H200", 0.2244),
           ("moe.experts", "bf16-tokens<=8192"): ("grouped_mm GEMMs only H200", 15.70 + 8.00),
           ("attn_res.mix", "bf16-S9-R<=8192"): ("copy of its bytes at 4.25 TB/s H200", 10 * 8192 * 7168 * 2 / 4.25e9)}


def kda_specs(ctx) -> list:
    """(op, candidates, default order, parity case, timed cases) of k3::kda; a case is (tag, B, T)."""
    from k3x.custom_ops.kda import candidates as kc

    st = ctx.selftest
    prefill = [("T70", 1, 70)] if st else [(f"B1-T{T}", 1, T) for T in (4096, 16384, 1024)]
    decode = [(f"B{B}", B, 1) for B in ((1, 3) if st else (1, 64, 8, 256))]
    return [(kc.PREFILL, kc.CANDIDATES[kc.PREFILL], ("T70", 1, 70) if st else ("B1-T300", 1, 300), prefill),
            (kc.DECODE, kc.CANDIDATES[kc.DECODE], ("B3", 3, 1) if st else ("B8", 8, 1), decode)]


def kda_case(ctx, gc, op: str, B: int, T: int):
    """(class, run(candidate) -> outputs, reference() -> the oracle's outputs, output names)."""
    from k3x.custom_ops.kda import candidates as kc

    H, K, V = (2, 16, 32) if ctx.selftest else (96, 128, 128)
    q, k, v, g, beta, h0 = gc._kda_inputs(B, T, H, K, V, ctx.dtype, ctx.device)

    def reference():
        from k3x.custom_ops.kda import reference as ref

        f = ref.kda_recurrent if op == kc.DECODE else ref.kda_chunked
        return f(*(x.double() for x in (q, k, v, g, beta)), scale=K ** -0.5, initial_state=h0.double())
    return (kc.shape_class(op, B, T, ctx.dtype), lambda c: c.run(q, k, v, g, beta, K ** -0.5, h0, -5.0), reference,
            ("o", "final_state"))


def attn_specs(ctx) -> list:
    """AttnRes over 8 bank sources (and 1) at d = 7168: decode batches to prefill chunks of rows."""
    from k3x.custom_ops.attn_res import candidates as ac

    timed = [("R3-N2", 3, 2)] if ctx.selftest else [(f"R{R}-N{N}", R, N) for R, N in
                                                     ((8192, 8), (8192, 1), (1024, 8), (64, 8), (1, 8))]
    return [(ac.MIX, ac.CANDIDATES, ("R3-N2", 3, 2) if ctx.selftest else ("R64-N8", 64, 8), timed)]


def attn_case(ctx, gc, R: int, N: int):
    import torch

    from k3x.custom_ops.attn_res import candidates as ac

    d = 100 if ctx.selftest else 7168
    prefix = (torch.randn(R, d, device=ctx.device) * 4).to(ctx.dtype)
    bank = torch.randn(R, N, d, device=ctx.device).to(ctx.dtype)
    nw, pw = 1 + 0.1 * torch.randn(d, device=ctx.device), torch.randn(d, device=ctx.device) * 0.05

    def reference():
        from k3x.custom_ops.attn_res import reference as ref

        return (ref.attn_res(prefix.double(), bank, nw, pw, 1e-5),)
    return (ac.shape_class(R, N, ctx.dtype), lambda c: (c.run(prefix, bank, nw, pw, 1e-5),), reference, ("out",))


def packed_specs(ctx) -> list:
    """The serving step's KDA: decode steps of 1, 64 and 256 sequences (the short candidates), prefill chunks of
    4096, 1024 and 16384 rows (the chunked ones), each set checked at a step of its own kind first."""
    from k3x.custom_ops.kda_packed import candidates as pc

    st = ctx.selftest
    short = [("B2", (1, 1), 0)] if st else [(f"B{B}", (1,) * B, 0) for B in (1, 64, 256)]
    chunks = [("N21", (20, 1), 0)] if st else [(f"N{n}", (n,), 0) for n in (4096, 1024, 16384)]
    return [(pc.STEP, pc.SHORT, ("B9-short", (1,) * 8 + (3,), 0), short),
            (pc.STEP, pc.MIXED, ("N40-mixed", (20, 1, 5, 14), 0) if st else ("N323-mixed", (300, 1, 5, 17), 0),
             chunks)]


def packed_case(ctx, lens: tuple):
    import gpu_check_serving as serving  # noqa: E402 (bench/)
    from k3x.custom_ops.kda_packed import candidates as pc

    H, K, V = (2, 16, 32) if ctx.selftest else (96, 128, 128)
    a = serving.kda_packed_inputs(list(lens), H, K, V, ctx.dtype, ctx.device)

    def reference():
        from k3x.custom_ops.kda_packed import reference as ref

        return ref.kda_packed(*(x.double() if x.is_floating_point() else x for x in a), scale=K ** -0.5)
    return (pc.shape_class(sum(lens), len(lens), ctx.dtype), lambda c: c.run(*a, K ** -0.5, -5.0), reference,
            ("o", "final_state"))


def moe_specs(ctx) -> list:
    from k3x.custom_ops.moe import candidates as mc

    tokens = [9] if ctx.selftest else [8192, 1024, 4096, 1, 64, 256, 16]
    return [(mc.EXPERTS, mc.CANDIDATES, (f"N{9 if ctx.selftest else 64}", 9 if ctx.selftest else 64, 0),
             [(f"N{n}", n, 0) for n in tokens])]


class MoEWeights:
    """K3's routed experts (bf16, ~59 GB at E=896) made once for every MoE case; tiny in the self-test."""
    def __init__(self, ctx):
        import torch

        self.E, self.k, self.d, self.L, self.I = (6, 2, 24, 16, 24) if ctx.selftest else (896, 16, 7168, 3584, 3072)
        dev, dt, E, d, L, I = ctx.device, ctx.dtype, self.E, self.d, self.L, self.I
        self.gw = (torch.randn(E, d, device=dev) * d ** -0.5).to(dt)
        self.gb = torch.randn(E, device=dev) * 0.1
        self.w1, self.w3 = (torch.empty(E, I, L, device=dev, dtype=dt).normal_(std=L ** -0.5) for _ in range(2))
        self.w2 = torch.empty(E, L, I, device=dev, dtype=dt).normal_(std=I ** -0.5)


def moe_case(ctx, gc, w: MoEWeights, N: int):
    import torch

    from k3x.custom_ops.moe import candidates as mc

    x = torch.randn(N, w.d, device=ctx.device).to(ctx.dtype)
    z = torch.randn(N, w.L, device=ctx.device).to(ctx.dtype)
    args = (x, z, w.gw, w.gb, w.w1, w.w3, w.w2, w.k, 1.0, True, "situ", 4.0, 25.0, None)

    def reference():
        from k3x.custom_ops.moe import reference as ref

        return (ref.moe(*args),)
    return mc.shape_class(N, ctx.dtype), lambda c: (c.run(*args),), reference, ("u",)


def load(ctx, path: Path) -> dict:
    """The table to resume: --tune-from, else a cut one (complete: false) at `path`, as a process of this run
    leaves it before gpu_check_restart hands the rest to a fresh one; a finished table there is replaced."""
    if ctx.tune_from is not None:
        return json.loads(Path(ctx.tune_from).read_text())
    table = json.loads(path.read_text()) if path.is_file() else {}
    return table if table.get("complete") is False else {}


def write(path: Path, table: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(table, indent=1, sort_keys=True))
    os.replace(tmp, path)


def timed(ctx, gc, fn) -> tuple[float, str]:
    if ctx.selftest:
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3, "one call, wall (self-test)"
    return gc.device_time_within(fn)


def run_op(ctx, gc, table: dict, spec, case, out: list, save) -> bool:
    """Parity, then timing, of one op's candidates; False when the section's budget ran out."""
    op, cands, parity_case, timed_cases = spec
    verdicts = table.setdefault("parity", {}).setdefault(f"{op}@{parity_case[0]}", {})
    runnable = []
    for c in cands:
        why = c.missing() or (None if c.interprets or not ctx.selftest else "does not run under the interpreter")
        if why is None and ctx.selftest and c.name.startswith("k3x-") and any(
                r.name.startswith("k3x-") for r in runnable):
            why = "self-test: one launch entry stands for all"
        if why:
            out.append(gc.Result(f"tune {op} {c.name}", "info", None, note=f"left out: {why}"))
        else:
            runnable.append(c)
    _, run, reference, names = case(parity_case[1], parity_case[2])
    expected = None
    for c in runnable:
        if c.name in verdicts:
            continue
        if ctx.time_left() < 10:
            out.append(gc.Result(f"tune {op}", "info", None, note=f"parity stopped before {c.name}: budget"))
            return False
        expected = reference() if expected is None else expected
        try:
            got = run(c)
            rows = [gc._compare(f"tune parity {op} {c.name} {parity_case[0]} {n}", a, e, ctx.dtype)
                    for n, a, e in zip(names, got, expected)]
        except Exception as exc:  # noqa: BLE001 - a candidate that raises fails its parity, reported
            rows = [gc.Result(f"tune parity {op} {c.name}", "parity", False, note=f"{type(exc).__name__}: {exc}")]
        out.extend(rows)
        verdicts[c.name] = {"ok": all(r.ok for r in rows), "shape": parity_case[0],
                            "rmse_ratio": max((r.metrics.get("rmse_ratio", 1.0) for r in rows), default=1.0)}
        save()
    passing = [c for c in runnable if verdicts.get(c.name, {}).get("ok")]
    entries = table.setdefault("ops", {}).setdefault(op, {})
    for tag, a, b in timed_cases:
        cls, run, _, _ = case(a, b)
        if cls in entries:
            out.append(gc.Result(f"tune {op} {cls}", "info", None, note=f"resumed: {entries[cls]['order']}"))
            continue
        ms, how = {}, {}
        for c in passing:
            if ctx.time_left() < 10:
                out.append(gc.Result(f"tune {op} {cls}", "info", None, note=f"stopped at {c.name}: budget"))
                return False
            try:
                ms[c.name], how[c.name] = timed(ctx, gc, lambda c=c: run(c))
            except Exception as exc:  # noqa: BLE001 - reported; the candidate is left out of this class
                out.append(gc.Result(f"tune {op} {cls} {c.name}", "error", False, note=f"{type(exc).__name__}: {exc}"))
        if not ms:
            continue
        order = sorted(ms, key=ms.get)
        entries[cls] = {"order": order, "ms": ms, "shape": tag, "timing": how}
        save()
        anchor = ANCHORS.get((op, cls))
        m = {f"{n}_ms": ms[n] for n in order} | {"pick": order[0]}
        m |= {"anchor": anchor[0], "anchor_ms": anchor[1]} if anchor else {}
        out.append(gc.Result(f"tune {op} {cls} ({tag})", "bench", None, m, "; ".join(sorted(set(how.values())))))
    return True


def tune(ctx) -> list:
    """The section: every op's candidates checked and timed; the table written as it grows (module docstring)."""
    gc = sys.modules[type(ctx).__module__]  # bench/gpu_check.py, run as __main__ or imported
    import torch
    import triton

    from k3x.custom_ops.dispatch import device_kind
    from k3x.plan.dispatch import FORMAT

    kind = device_kind()
    path = Path(os.environ.get("OUT", "./out")) / "tuned" / f"{kind}.json"
    table = load(ctx, path)
    if table and table.get("kind") != kind:
        note = f"--tune-from holds a {table.get('kind')} table, this is {kind}"
        return [gc.Result("tune", "error", False, note=note)]
    fla = None if ctx.selftest else gc._fla()[1]  # fla's autotuners cut before its kernels first run
    table |= {"format": FORMAT, "kind": kind, "complete": False, "selftest": ctx.selftest,
              "device": torch.cuda.get_device_name() if ctx.device == "cuda" else "cpu (interpreter)",
              "versions": {"torch": torch.__version__, "triton": triton.__version__, "fla_autotune": fla}}
    out = [gc.Result("tune table", "info", None, {"path": str(path)}, f"resumed from {ctx.tune_from}"
                     if ctx.tune_from else "")]
    save = lambda: write(path, table)  # noqa: E731
    finished = all(run_op(ctx, gc, table, spec, lambda B, T: kda_case(ctx, gc, spec[0], B, T), out, save)
                   for spec in kda_specs(ctx))
    finished = finished and all(run_op(ctx, gc, table, spec, lambda lens, _: packed_case(ctx, lens), out, save)
                                for spec in packed_specs(ctx))
    finished = finished and all(run_op(ctx, gc, table, spec, lambda R, N: attn_case(ctx, gc, R, N), out, save)
                                for spec in attn_specs(ctx))
    finished = finished and ctx.time_left() > 10
    if finished:
        if ctx.device == "cuda":
            torch.cuda.empty_cache()  # K3's experts are ~59 GB: the KDA and AttnRes cases' cached blocks go first
        weights = MoEWeights(ctx)
        finished = all(run_op(ctx, gc, table, spec, lambda N, _: moe_case(ctx, gc, weights, N), out, save)
                       for spec in moe_specs(ctx))
        del weights
    table["complete"] = bool(finished)
    save()
    if not finished:
        out.append(gc.Result("tune", "info", None, note=f"cut: rerun with --only tune --tune-from {path}"))
    return out
