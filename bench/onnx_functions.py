"""ONNX layer functions vs the flat graph: graph file size, node counts, ORT session creation.

    python bench/onnx_functions.py [--preset k3-bench] [--rounds 5] [--json OUT]

One trace (fp32, random weights, seed 0); the `ort` flavor written flat (`layer_functions=False`, weights in
`model.onnx.data`, so `model.onnx` is the graph alone), then the same file with its layers as functions
(exporter/onnx_functions.functionalize, as `k3x export` writes it) beside it, sharing the data file. Sessions
(CPU provider, default optimisation level) are created interleaved, A B A B with the first case alternating per
round; medians and ranges (lowest, highest) are reported. Both sessions then run one prefill (batch 1, 8 tokens)
and its logits are compared bit for bit.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path


def _session(path: Path, threads: int):
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.log_severity_level = 3
    so.intra_op_num_threads = threads
    t = time.perf_counter()
    s = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    return s, time.perf_counter() - t


def _logits(s, vocab: int):
    import numpy as np

    ids = np.random.default_rng(0).integers(0, vocab, (1, 8)).astype(np.int64)
    feeds = {"input_ids": ids}
    for i in s.get_inputs()[1:]:
        feeds[i.name] = np.zeros([1 if d == "batch" else 0 if d == "past_seq" else d for d in i.shape], np.float32)
    return s.run(["logits"], feeds)[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="k3-bench")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()

    import numpy as np
    import onnx

    from k3x.exporter.onnx import OnnxOptions, export_onnx
    from k3x.exporter.onnx_functions import functionalize
    from k3x.exporter.stamp import trace_recorded
    from k3x.model import build_model, preset

    cfg = preset(a.preset)
    model = build_model(cfg, seed=0)
    ep, _ = trace_recorded(model)
    with tempfile.TemporaryDirectory(prefix="k3x-bench-fn-") as tmp:
        out = Path(tmp)
        export_onnx(ep, cfg, out, OnnxOptions(flavors=("ort",), external_data=True, layer_functions=False))
        proto = onnx.load(str(out / "model.onnx"), load_external_data=False)
        flat_nodes = len(proto.graph.node)
        t = time.perf_counter()
        calls = functionalize(proto, [cfg.layer_kind(i) for i in range(cfg.num_layers)],
                              set(ep.state_dict) | set(ep.constants))
        functionalize_s = time.perf_counter() - t
        onnx.save(proto, str(out / "functions.onnx"))
        cases = {"flat": out / "model.onnx", "functions": out / "functions.onnx"}
        times: dict[str, list[float]] = {c: [] for c in cases}
        for r in range(a.rounds):
            for c in (list(cases) if r % 2 == 0 else list(reversed(cases))):
                s, seconds = _session(cases[c], a.threads)
                times[c].append(seconds)
                del s
        flat_logits, fn_logits = (_logits(_session(cases[c], a.threads)[0], cfg.vocab_size) for c in cases)
        result = {
            "preset": cfg.name, "rounds": a.rounds, "calls": calls, "functionalize_s": round(functionalize_s, 3),
            "graph_bytes": {c: p.stat().st_size for c, p in cases.items()},
            "data_bytes": (out / "model.onnx.data").stat().st_size,
            "main_graph_nodes": {"flat": flat_nodes, "functions": len(proto.graph.node)},
            "function_nodes": {f.name: len(f.node) for f in proto.functions},
            "session_s": {c: {"median": round(statistics.median(v), 3), "min": round(min(v), 3),
                              "max": round(max(v), 3)} for c, v in times.items()},
            "logits_bit_identical": bool(np.array_equal(flat_logits, fn_logits)),
            "logits_max_abs_diff": float(np.abs(flat_logits - fn_logits).max()),
        }
    print(json.dumps(result, indent=2))
    if a.json:
        a.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
