"""Full-size trace benchmark: `torch.export` of huge configs on the meta device, beside an anchor.

Each case runs in its own subprocess (so peak RSS is that case's alone; one case at a time) and reports:
parameter count, graph nodes, custom-op counts, model construction time, trace wall and CPU seconds,
optionally the weightless `.pt2` save (wall and CPU seconds, file bytes) by `torch.export.save` and by
exporter/stamp_save.save_fast (timed first, so it never finds torch's caches warm; `same` says whether its
archive equals torch's record for record), and peak RSS (`ru_maxrss`). CPU seconds are the steadier figure
on a shared machine; wall seconds are what a user waits. `x anchor` is a case's trace + save CPU seconds over
the anchor's trace CPU seconds, measured in the same round (`x fast`: with the fast save). `--repeat N` runs
the cases N rounds, interleaved (anchor, k3, anchor, k3, ...).

    python bench/export_full.py                                  # anchor, kimi-linear-48b, k3 (bf16)
    python bench/export_full.py --presets k3 --per-layer --save  # stamped vs per-layer trace, and .pt2 save
    python bench/export_full.py --presets k3 --baseline --save   # also the pre-tuning trace
    python bench/export_full.py --presets k3 --save --repeat 3   # three interleaved rounds
    python bench/export_full.py --json out.json

Cases:
- `anchor`: a plain torch.export of a 93-layer meta `nn.Linear(173500, 173500)` stack (2.8e12
  parameters, dynamic batch/seq) — the reference point for the trace time of a model this size.
- `<preset>`: `k3x.exporter.stamp.trace_stamped` of `build_model(preset, device="meta")` (each distinct layer
  traced once: the export pipeline's default).
- `<preset>@per-layer` (with --per-layer): `k3x.exporter.trace.trace` of the same (every layer traced).
- `<preset>@baseline` (with --baseline): plain `torch.export.export` of the same model with torch's
  defaults (fake-tensor cache on), i.e. what trace() did before its tuning.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
import zipfile

ANCHOR_LAYERS, ANCHOR_WIDTH = 93, 173_500  # 93 * 173500^2 = 2.80e12 parameters


def _child(case: str, dtype_name: str, save: bool) -> dict:
    t0 = time.perf_counter()
    import torch

    from torch.export import Dim

    from k3x.plan.dtypes import torch_dtype

    dtype = torch_dtype(dtype_name)

    out: dict = {"case": case, "dtype": dtype_name}
    name, _, variant = case.partition("@")
    t1 = time.perf_counter()
    c1 = time.process_time()
    if name == "anchor":
        with torch.device("meta"):
            model = torch.nn.Sequential(*[torch.nn.Linear(ANCHOR_WIDTH, ANCHOR_WIDTH, bias=False, dtype=dtype)
                                          for _ in range(ANCHOR_LAYERS)])
        args = (torch.zeros(2, 3, ANCHOR_WIDTH, dtype=dtype, device="meta"),)
        dyn = ({0: Dim("batch", min=1, max=64), 1: Dim("seq", min=1, max=4096)},)
        export = lambda: torch.export.export(model, args, dynamic_shapes=dyn)  # noqa: E731
        out["import_s"] = round(t1 - t0, 2)
    else:
        from k3x.exporter import trace as tr
        from k3x.model import build_model, preset

        out["import_s"] = round(time.perf_counter() - t0, 2)
        t1, c1 = time.perf_counter(), time.process_time()
        model = build_model(preset(name), device="meta", dtype=dtype, seed=None)
        if variant == "baseline":
            ids, past = tr.example_inputs(model.cfg, dtype=dtype, device="meta")

            def export():
                with torch.no_grad():
                    return torch.export.export(model, (ids, past), dynamic_shapes=tr.dynamic_shapes(model.cfg))
        else:
            from k3x.exporter.stamp import trace_stamped

            export = (lambda: tr.trace(model)) if variant == "per-layer" else (lambda: trace_stamped(model))
    out["params"] = sum(p.numel() for p in model.parameters())
    t2, c2 = time.perf_counter(), time.process_time()
    ep = export()
    t3, c3 = time.perf_counter(), time.process_time()
    out.update(build_s=round(t2 - t1, 2), build_cpu_s=round(c2 - c1, 2), trace_s=round(t3 - t2, 2),
               trace_cpu_s=round(c3 - c2, 2), nodes=len(ep.graph.nodes))
    if name != "anchor":
        from k3x.exporter.trace import op_counts

        out["op_counts"] = op_counts(ep)
    if save:
        from k3x.exporter.stamp_save import save_fast

        with tempfile.TemporaryDirectory() as d:
            for key, fn in (("fast_save", save_fast), ("save", torch.export.save)):
                os.mkdir(os.path.join(d, key))  # the same file name: torch names the archive's folder after it
                path = os.path.join(d, key, "model.pt2")
                t4, c4 = time.perf_counter(), time.process_time()
                fn(ep, path)
                out[f"{key}_s"], out[f"{key}_cpu_s"] = round(time.perf_counter() - t4, 2), round(time.process_time() - c4, 2)
            out["pt2_bytes"] = os.path.getsize(path)
            out["same"] = _records(os.path.join(d, "fast_save", "model.pt2")) == _records(path)
    out["peak_rss_mb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    return out


def _records(path: str) -> list[tuple[str, bytes]]:
    with zipfile.ZipFile(path) as z:
        return [(i.filename, z.read(i)) for i in z.infolist()]


def _run_case(case: str, dtype: str, save: bool) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        path = f.name
    try:
        cmd = [sys.executable, __file__, "--child", case, "--dtype", dtype, "--json", path]
        t = time.perf_counter()
        proc = subprocess.run(cmd + (["--save"] if save else []), capture_output=True, text=True)
        if proc.returncode != 0:
            last = proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else f"exit {proc.returncode}"
            return {"case": case, "error": last}
        res = json.loads(open(path).read())
        res["process_s"] = round(time.perf_counter() - t, 2)
        return res
    finally:
        os.unlink(path)


def _cell(row: dict, key: str) -> str:
    if "error" in row and key != "case":
        return row["error"][:60] if key == "params" else ""
    v = row.get(key)
    return "-" if v is None else f"{v:.3g}" if key == "params" else str(v)


def _ratios(rows: list[dict]) -> None:
    """`x_anchor` / `x_fast`: trace + save / fast save CPU seconds over the anchor's trace CPU seconds (same
    round)."""
    anchors = {r.get("round"): r.get("trace_cpu_s") for r in rows if r["case"] == "anchor"}
    for r in rows:
        anchor = anchors.get(r.get("round"))
        if anchor and "trace_cpu_s" in r:
            r["x_anchor"] = round((r["trace_cpu_s"] + r.get("save_cpu_s", 0.0)) / anchor, 2)
            if "fast_save_cpu_s" in r:
                r["x_fast"] = round((r["trace_cpu_s"] + r["fast_save_cpu_s"]) / anchor, 2)


def _table(rows: list[dict]) -> str:
    cols = [("case", "case"), ("round", "round"), ("params", "params"), ("nodes", "nodes"), ("build_s", "build s"),
            ("trace_s", "trace s"), ("trace_cpu_s", "trace cpu s"), ("save_s", "save s"),
            ("save_cpu_s", "save cpu s"), ("fast_save_s", "fast save s"), ("fast_save_cpu_s", "fast save cpu s"),
            ("same", "same"), ("pt2_bytes", "pt2 bytes"), ("x_anchor", "x anchor"), ("x_fast", "x fast"),
            ("peak_rss_mb", "peak RSS MB"), ("process_s", "process s")]
    lines = [[h for _, h in cols]] + [[_cell(r, k) for k, _ in cols] for r in rows]
    widths = [max(len(x[i]) for x in lines) for i in range(len(cols))]
    return "\n".join("  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(x, widths)))
                     for x in lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--presets", nargs="+", default=["kimi-linear-48b", "k3"])
    ap.add_argument("--dtype", choices=["fp32", "bf16"], default="bf16")
    ap.add_argument("--baseline", action="store_true", help="also run each preset with plain torch.export defaults")
    ap.add_argument("--per-layer", action="store_true", help="also run each preset with the per-layer trace")
    ap.add_argument("--save", action="store_true", help="also time torch.export.save of the weightless program "
                    "(the anchor's too)")
    ap.add_argument("--repeat", type=int, default=1, help="rounds of all cases, interleaved")
    ap.add_argument("--json", default="export_full.json", help="where to write the results")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        res = _child(a.child, a.dtype, a.save)
        with open(a.json, "w") as f:
            json.dump(res, f)
        return
    variants = [v for v, on in (("baseline", a.baseline), ("per-layer", a.per_layer)) if on]
    cases = ["anchor"] + [c for p in a.presets for c in [f"{p}@{v}" for v in variants] + [p]]
    rows = []
    for r in range(1, a.repeat + 1):
        for c in cases:
            rows.append({**_run_case(c, a.dtype, a.save), "round": r})
            print(f"  done {c} ({r}): {rows[-1].get('trace_s', rows[-1].get('error'))}", file=sys.stderr, flush=True)
    _ratios(rows)
    report = {"dtype": a.dtype, "cpu_count": os.cpu_count(), "loadavg_end": os.getloadavg(), "results": rows}
    with open(a.json, "w") as f:
        json.dump(report, f, indent=2)
    print(_table(rows))
    print(f"(dtype {a.dtype}; {os.cpu_count()} CPUs; load average at end {os.getloadavg()[0]:.1f}; json: {a.json})")


if __name__ == "__main__":
    main()
