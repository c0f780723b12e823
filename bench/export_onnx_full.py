"""Weightless ONNX export of a large preset (default: the full 93-layer `k3`) on the meta device.

Measures wall time per phase (build, torch.export (stamped trace), ONNX export + flavor files with flat layers, the same
files with layer functions (exporter/onnx_functions.py, `functions.<file>`), onnx.checker full check of all)
and the process's peak RSS; prints a table and writes JSON, with each file's bytes and main-graph nodes.
Nothing allocates weights: the model lives on the meta device, the exporter runs without its optimizer and
every weight becomes a graph input.

    python bench/export_onnx_full.py [--preset k3] [--out DIR] [--json bench_onnx_full.json]
"""

from __future__ import annotations

import argparse
import json
import resource
import tempfile
import time
from pathlib import Path


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="k3")
    ap.add_argument("--out", type=Path, default=None, help="keep the files here (default: a temp dir)")
    ap.add_argument("--json", type=Path, default=Path("bench_onnx_full.json"))
    args = ap.parse_args()

    import onnx

    from k3x.exporter.onnx import OnnxOptions, export_onnx
    from k3x.exporter.onnx_functions import functionalize
    from k3x.exporter.stamp import trace_recorded
    from k3x.model import build_model, preset

    phases: dict[str, float] = {}
    cpu: dict[str, float] = {}

    def timed(name, fn):
        t, c = time.perf_counter(), cpu_seconds()
        result = fn()
        phases[name], cpu[name] = time.perf_counter() - t, cpu_seconds() - c
        return result

    import torch

    cfg = preset(args.preset)
    model = timed("build_meta", lambda: build_model(cfg, device="meta", dtype=torch.bfloat16, seed=None))
    ep = timed("torch_export", lambda: trace_recorded(model)[0])  # stamped, as `k3x export` traces
    out = args.out or Path(tempfile.mkdtemp(prefix="k3x-onnx-full-"))
    out.mkdir(parents=True, exist_ok=True)
    art = timed("onnx_export", lambda: export_onnx(ep, cfg, out, OnnxOptions(weights=False, layer_functions=False)))
    kinds, weights = [cfg.layer_kind(i) for i in range(cfg.num_layers)], set(ep.state_dict) | set(ep.constants)

    def with_functions() -> dict:
        files = {}
        for f, p in art.files.items():
            proto = onnx.load(str(p), load_external_data=False)
            functionalize(proto, kinds, weights)
            files[f"{f}+functions"] = p.with_name(f"functions.{p.name}")
            onnx.save(proto, str(files[f"{f}+functions"]))
        return files

    files = {**art.files, **timed("layer_functions", with_functions)}
    timed("checker_full", lambda: [onnx.checker.check_model(str(p), full_check=True) for p in files.values()])
    result = {
        "preset": cfg.name, "parameters": sum(p.numel() for p in model.parameters()),
        "files": {f: {"path": str(p), "bytes": p.stat().st_size,
                      "graph_nodes": len(onnx.load(str(p), load_external_data=False).graph.node)}
                  for f, p in files.items()},
        "nodes": art.num_nodes, "k3_nodes": art.op_counts, "seconds": {k: round(v, 2) for k, v in phases.items()},
        "cpu_seconds_by_phase": {k: round(v, 2) for k, v in cpu.items()},
        "total_seconds": round(sum(phases.values()), 2), "cpu_seconds": round(cpu_seconds(), 1), "peak_rss_mib": round(peak_rss_mib(), 1),
    }
    for k, v in phases.items():
        print(f"{k:<14} {v:8.2f} s wall {cpu[k]:8.2f} s CPU")
    print(f"{'total':<14} {result['total_seconds']:8.2f} s ({result['cpu_seconds']:.0f} s CPU)   peak RSS {result['peak_rss_mib']:.0f} MiB   "
          f"{result['parameters'] / 1e12:.2f}T parameters, {art.num_nodes} nodes, {art.op_counts}")
    for f, info in result["files"].items():
        print(f"{f}: {info['path']} ({info['bytes'] / 2**20:.1f} MiB, {info['graph_nodes']} main-graph nodes), "
              "onnx.checker full_check passed")
    args.json.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
