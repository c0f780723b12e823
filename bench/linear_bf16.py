"""The k3::LinearBF16 ONNX Runtime CPU kernel (custom_ops/linear_bf16/ort_kernel.cc) against the machine's
weight-streaming floor and against ONNX Runtime's own fp32 MatMul (MLAS), on the trunk shapes of two presets.

- decode (GEMV, 1 row; --rows): each projection shape of the preset's trunk as a model of COPIES nodes on the
  same x with distinct bf16 weights, at least --bytes of them in all (so the weights come from memory, not from
  the 32 MB L3, as a decode step's do): kernel ms a node, its GB/s (bf16 bytes / time), and `floor_share` =
  the measured streaming bandwidth's share reached; the floor is a sum over an fp32 buffer of the same bytes on
  the same threads (bench/cpu_decode.stream_ms), measured right after each call. Also the ORT fp32 MatMul of
  the same weights (the node's function body: the Cast of the initializer folded, 4 bytes a weight).
- prefill (GEMM, --prefill-rows rows): kernel ms against ONNX Runtime's fp32 MatMul on the same shape (the
  body), `ratio` = kernel / MatMul.
Cases are interleaved call by call, so a load that changes during the run weighs on each alike; medians over
--repeats. Neither ONNX Runtime's pools (one per session) nor torch's threads spin when idle: each would take
the cores from the call after it (measured: with spinning the floor itself fell from ~29 to ~11 GB/s). So each
call pays its pool's wake-up, which weighs on the small weights (a model's nodes run back to back, its pool
awake). The load average is recorded beside the figures. Builds the kernel library (`k3x build-ort-kernels`).

    python bench/linear_bf16.py [--presets k3-bench,kimi-linear-mid] [--threads 2] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path


def trunk_shapes(name: str) -> dict[str, tuple[int, int]]:
    """(N, K) of the preset's dense projections (nn.Linear's [out, in]), the largest of each kind."""
    from k3x.model.config import preset

    c = preset(name)
    d, kda, mla = c.hidden_size, c.kda, c.mla
    shapes = {"dense_up": (c.dense_intermediate_size, d), "dense_down": (d, c.dense_intermediate_size),
              "kda_proj": (kda.num_heads * kda.head_dim, d),
              "mla_kv_b": (mla.num_heads * (mla.qk_nope_head_dim + mla.v_head_dim), mla.kv_lora_rank),
              "mla_o": (d, mla.num_heads * mla.v_head_dim), "lm_head": (c.vocab_size, d)}
    if mla.q_lora_rank:
        shapes["mla_q_b"] = (mla.num_heads * (mla.qk_nope_head_dim + mla.qk_rope_head_dim), mla.q_lora_rank)
    return shapes


def model(N: int, K: int, copies: int, seed: int):
    """`copies` k3::LinearBF16 nodes on one x [.., K], each its own bf16 weight [N, K], with the function body."""
    import numpy as np
    from onnx import TensorProto, helper

    from k3x.custom_ops.linear_bf16.onnx import function

    rng = np.random.default_rng(seed)
    nodes, inits, outs = [], [], []
    for i in range(copies):
        bits = (rng.standard_normal((N, K), np.float32) / K ** 0.5).view(np.uint32) >> 16  # truncated to bf16
        inits.append(helper.make_tensor(f"w{i}", TensorProto.BFLOAT16, [N, K], bits.astype(np.uint16).tobytes(),
                                        raw=True))
        nodes.append(helper.make_node("LinearBF16", ["x", f"w{i}"], [f"y{i}"], domain="k3", plugin_namespace="k3"))
        outs.append(helper.make_tensor_value_info(f"y{i}", TensorProto.FLOAT, None))
    graph = helper.make_graph(nodes, "linear", [helper.make_tensor_value_info("x", TensorProto.FLOAT, None)], outs,
                              initializer=inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20), helper.make_opsetid("k3", 1)],
                             ir_version=10, functions=[function(20, nodes[:1])[0]])


def sessions(proto, threads: int, library: Path) -> dict:
    """The kernel (library loaded) and the function body (MLAS fp32 MatMul) on the same model."""
    import onnxruntime as ort

    out = {}
    for name, lib in (("kernel", library), ("matmul", None)):
        so = ort.SessionOptions()
        so.intra_op_num_threads = threads
        so.add_session_config_entry("session.intra_op.allow_spinning", "0")  # an idle pool leaves the cores
        if lib is not None:
            so.register_custom_ops_library(str(lib))
        out[name] = ort.InferenceSession(proto.SerializeToString(), so, providers=["CPUExecutionProvider"])
    return out


def timed(sess, feeds) -> float:
    t = time.perf_counter()
    sess.run(None, feeds)
    return time.perf_counter() - t


def measure(cases: list[dict], repeats: int) -> None:
    """Each case's calls interleaved with the others' (and a floor after each decode call); medians in place."""
    import torch

    from k3x.bench.cpu_decode import stream_ms

    buf = torch.ones(max(c["bytes"] for c in cases) // 4 + 1)
    for c in cases:  # warm-up: first runs (pre-packing, pages) are not timed
        for s in c["sessions"].values():
            s.run(None, c["feeds"])
    times = [{"kernel": [], "matmul": [], "floor": []} for _ in cases]
    for _ in range(repeats):
        for c, t in zip(cases, times):
            for name, s in c["sessions"].items():
                t[name].append(timed(s, c["feeds"]) * 1e3 / c["copies"])
            if c["kind"] == "decode":
                t["floor"].append(stream_ms(buf, c["bytes"]) / c["copies"])
    for c, t in zip(cases, times):
        c.update({f"{k}_ms": statistics.median(v) for k, v in t.items() if v})
        del c["sessions"], c["feeds"]
        if c["kind"] == "decode":
            per = c["bytes"] / c["copies"]
            c["kernel_GBps"], c["floor_GBps"] = per / c["kernel_ms"] / 1e6, per / c["floor_ms"] / 1e6
            c["floor_share"] = c["floor_ms"] / c["kernel_ms"]
            c["matmul_fp32_GBps"] = 2 * per / c["matmul_ms"] / 1e6
        else:
            c["ratio"] = c["kernel_ms"] / c["matmul_ms"]
            c["kernel_GFLOPs"] = 2 * c["rows"] * c["N"] * c["K"] / c["kernel_ms"] / 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--presets", default="k3-bench,kimi-linear-mid")
    ap.add_argument("--rows", type=int, default=1, help="decode rows (1 to 4: the GEMV path)")
    ap.add_argument("--prefill-rows", type=int, default=128)
    ap.add_argument("--bytes", type=int, default=128 << 20, help="bf16 weight bytes a decode case streams at least")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()

    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # torch's floor threads must not spin into the next call
    import numpy as np
    import torch

    from k3x.runtime.ort_kernels import build

    torch.set_num_threads(args.threads)
    library = build(lambda m: print(m, flush=True))
    shapes: dict[tuple[int, int], list[str]] = {}
    for p in args.presets.split(","):
        for name, nk in trunk_shapes(p).items():
            shapes.setdefault(nk, []).append(f"{p}:{name}")
    cases, rng = [], np.random.default_rng(0)
    for (N, K), names in sorted(shapes.items()):
        copies = max(1, -(-args.bytes // (2 * N * K)))
        proto = model(N, K, copies, seed=N + K)
        x = rng.standard_normal((args.rows, K), np.float32)
        cases.append({"kind": "decode", "shape": names, "N": N, "K": K, "rows": args.rows, "copies": copies,
                      "bytes": 2 * N * K * copies, "sessions": sessions(proto, args.threads, library),
                      "feeds": {"x": x}})
    for N, K in sorted({nk for nk in shapes if nk[0] * nk[1] <= 1 << 24}):  # the GEMM cases (lm_head aside)
        x = rng.standard_normal((args.prefill_rows, K), np.float32)
        cases.append({"kind": "prefill", "shape": shapes[(N, K)], "N": N, "K": K, "rows": args.prefill_rows,
                      "copies": 2, "bytes": 4 * N * K, "sessions": sessions(model(N, K, 2, seed=N * K), args.threads,
                                                                            library), "feeds": {"x": x}})
    load = {"before": os.getloadavg()[0]}
    measure(cases, args.repeats)
    load["after"] = os.getloadavg()[0]
    print(f"k3::LinearBF16 kernel, ONNX Runtime CPU, {args.threads} threads, load average {load['before']:.2f} -> "
          f"{load['after']:.2f}, medians of {args.repeats}")
    print(f"{'decode':<8} {'N x K':>13} {'kernel ms':>10} {'GB/s':>7} {'floor GB/s':>11} {'share':>6} "
          f"{'fp32 MatMul ms':>15}  shapes")
    for c in (c for c in cases if c["kind"] == "decode"):
        print(f"{'':<8} {c['N']:>6} x {c['K']:<5} {c['kernel_ms']:>10.3f} {c['kernel_GBps']:>7.1f} "
              f"{c['floor_GBps']:>11.1f} {c['floor_share']:>6.2f} {c['matmul_ms']:>15.3f}  {', '.join(c['shape'])}")
    print(f"{'prefill':<8} {'N x K':>13} {'kernel ms':>10} {'GFLOP/s':>8} {'MatMul ms':>10} {'ratio':>6}  shapes "
          f"({args.prefill_rows} rows)")
    for c in (c for c in cases if c["kind"] == "prefill"):
        print(f"{'':<8} {c['N']:>6} x {c['K']:<5} {c['kernel_ms']:>10.3f} {c['kernel_GFLOPs']:>8.1f} "
              f"{c['matmul_ms']:>10.3f} {c['ratio']:>6.2f}  {', '.join(c['shape'])}")
    if args.json:
        args.json.write_text(json.dumps({"threads": args.threads, "load_average": load, "repeats": args.repeats,
                                         "cases": cases}, indent=1))


if __name__ == "__main__":
    main()
