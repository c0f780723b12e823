"""Expert-count scaling of the MXFP4 MoE: a decode step's and one node's cost with 16, 64 and 256 experts of the
same top-k, on the kernel library's k3::MoEMXFP4 kernel and on the node's function body (cpu_decode.py runs it).

- step (the issue's measure): the preset's model (random weights, seed 0, MXFP4 experts) with `cfg.moe`'s
  num_experts replaced (`dataclasses.replace`: the same top_k and expert shapes), each exported as the `ort`
  flavor (`expert_exports`); a [1, 128] prompt and one-token decode steps through the batch interface, each run
  in a process of its own (cpu_decode.py's `--child`, handed in as `run`), on the kernel and on the function
  body (K3X_ORT_KERNELS=0 in the child's environment: no kernel library, every k3 node on its body; the body
  costs ~15 ms a MoE node, so it runs fewer steps). The expert counts and the two paths take turns within each
  round (a load that changes over the run weighs on each alike); median wall ms per step and the CPU ms (all
  threads) per step. One intra-op thread by default (cpu_decode.py --expert-threads): then the CPU time is the
  step's work alone, where a second thread's spin-waiting adds to it and other processes on the two cores
  stretch the wall time (one run at load ~2.5, two threads: the kernel's wall ms per step went 59 / 65 / 41
  over 16 / 64 / 256 experts, its CPU ms 56 / 58 / 52).
- node: one k3::MoEMXFP4 node alone (`moe_node`, one token, one intra-op thread), the CPU time of its calling
  thread per call, every session's calls interleaved. Between calls, outside the timed region, a read of
  EVICT_BYTES (twice this machine's 32 MB L3) pushes the node's bytes out of the caches, so every expert count
  reads its hit experts and its gate rows from memory, as in a decode step, where the whole model streams past
  between one layer's calls. Without it E=16's 3 MB of experts stayed in L3 between the calls and E=256's
  53 MB did not: the ratio mixed cache residency with work.
`spread`: max / min over the expert counts of one path (the issue's bound: 1.2).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import replace
from pathlib import Path
from typing import Callable

EVICT_BYTES = 64 << 20
PATHS = {"kernel": {}, "body": {"K3X_ORT_KERNELS": "0"}}  # path -> what the child's environment adds


def spread(per: dict[int, float]) -> float:
    return max(per.values()) / min(per.values())


def moe_node(E: int, top_k: int, d: int, L: int, I: int):
    """One k3::MoEMXFP4 node with random packed experts (E8M0 bytes near 2^-6), its function body attached."""
    import onnx_ir as ir
    import torch
    from onnx import TensorProto, helper

    from k3x.exporter.onnx_flavors import ort_pass
    from k3x.plan import onnx_node

    g = torch.Generator().manual_seed(E)
    u8 = lambda *s, lo=0, hi=256: torch.randint(lo, hi, s, generator=g, dtype=torch.uint8)  # noqa: E731
    w = {"gate_weight": torch.randn(E, d, generator=g) * d ** -0.5, "gate_bias": torch.zeros(E),
         "w1": u8(E, I, L // 2), "w3": u8(E, I, L // 2), "w2": u8(E, L, I // 2), "w1_scale": u8(E, I, L // 32, lo=120,
         hi=122), "w3_scale": u8(E, I, L // 32, lo=120, hi=122), "w2_scale": u8(E, L, I // 32, lo=120, hi=122)}
    inits = [helper.make_tensor(n, TensorProto.UINT8 if t.dtype == torch.uint8 else TensorProto.FLOAT, list(t.shape),
                                t.contiguous().numpy().tobytes(), raw=True) for n, t in w.items()]
    inits.append(helper.make_tensor("expert_offset", TensorProto.INT32, [1], [0]))
    node = helper.make_node("MoEMXFP4", ["x", "z", *w, "expert_offset"], ["u"], domain=onnx_node.DOMAIN, top_k=top_k,
                            routed_scaling_factor=1.0, renormalize=1, activation="situ", situ_beta=4.0,
                            situ_linear_beta=25.0, num_experts=E, hidden_size=d, expert_dim=L, intermediate_size=I,
                            activations="bf16", **onnx_node.COMMON_ATTRIBUTES)
    graph = helper.make_graph([node], "moe", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", d]),
                                              helper.make_tensor_value_info("z", TensorProto.FLOAT, ["N", L])],
                              [helper.make_tensor_value_info("u", TensorProto.FLOAT, ["N", L])], initializer=inits)
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20), helper.make_opsetid("k3", 1)],
                              ir_version=10)
    return ir.serde.serialize_model(ort_pass(ir.serde.deserialize_model(proto)))


def node_scaling(counts: list[int], top_k: int, d: int, L: int, I: int, library, rounds: int = 40,
                 body_every: int = 4, evict_bytes: int = EVICT_BYTES) -> dict[str, dict[int, float]]:
    """A one-token MoE node (`moe_node`) with each expert count, median CPU ms per call (one thread), the caches
    evicted before every call: on the kernel (when `library` is built) and on the function body (every
    `body_every`-th round: ~15 ms a call)."""
    import numpy as np
    import onnxruntime as ort
    import torch

    sessions = {}
    for path, lib in (("kernel", library), ("body", None)):
        if path == "kernel" and lib is None:
            continue
        for E in counts:
            so = ort.SessionOptions()
            so.intra_op_num_threads = 1  # the node runs on the calling thread: its thread_time is the node's
            if lib is not None:
                so.register_custom_ops_library(str(lib))
            sessions[path, E] = ort.InferenceSession(moe_node(E, top_k, d, L, I).SerializeToString(), so,
                                                     providers=["CPUExecutionProvider"])
    g = torch.Generator().manual_seed(1)

    def feeds() -> dict:
        return {"x": torch.randn(1, d, generator=g).numpy(), "z": torch.randn(1, L, generator=g).numpy()}

    for sess in sessions.values():
        sess.run(None, feeds())  # first-call allocations
    evict = np.ones(max(1, evict_bytes // 4), np.float32)  # written once, so its pages are real
    times: dict[tuple[str, int], list[float]] = {key: [] for key in sessions}
    for i in range(rounds):
        for (path, E), sess in sessions.items():
            if path == "body" and i % body_every:
                continue
            f = feeds()
            evict.sum()
            t = time.thread_time()
            sess.run(None, f)
            times[path, E].append(time.thread_time() - t)
    out: dict[str, dict[int, float]] = {}
    for (path, E), t in times.items():
        out.setdefault(path, {})[E] = 1e3 * statistics.median(t)
    return out


def expert_exports(cfg, counts: list[int], out: Path) -> dict[int, Path]:
    """The `ort` flavor of `cfg`'s model (random weights, seed 0, MXFP4 experts) with each expert count, under
    out/E<count>/."""
    from k3x.exporter.onnx import OnnxOptions, export_onnx
    from k3x.exporter.trace import trace
    from k3x.model import build_model
    from k3x.model.options import BuildOptions

    files = {}
    for E in counts:
        c = replace(cfg, moe=replace(cfg.moe, num_experts=E))
        model = build_model(c, BuildOptions(expert_format="mxfp4"), seed=0)
        (out / f"E{E}").mkdir()
        files[E] = export_onnx(trace(model), c, out / f"E{E}", OnnxOptions(flavors=("ort",))).files["ort"]
        del model
    return files


def step_scaling(files: dict[int, Path], run: Callable[[Path, int, int, dict[str, str]], dict],
                 steps: dict[str, int], rounds: int) -> dict[str, dict[int, dict[str, float]]]:
    """Per path (of `steps`: "kernel", "body") and expert count: median wall ms and CPU ms per decode step.
    `run(onnx, experts, steps, env)`: one child process's decode figures ("decode_s", "cpu_s": lists; "kernels":
    whether its session had the kernel library, checked against the path)."""
    raw: dict[str, dict[int, dict[str, list[float]]]] = {p: {E: {"decode_s": [], "cpu_s": []} for E in files}
                                                         for p in steps}
    for _ in range(rounds):
        for E, onnx in files.items():
            for path, n in steps.items():
                got = run(onnx, E, n, PATHS[path])
                if got["kernels"] != (path == "kernel"):  # e.g. the sources changed while it ran: not built
                    raise RuntimeError(f"{path} path, {E} experts: the child ran "
                                       f"{'with' if got['kernels'] else 'without'} the kernel library")
                for key, r in raw[path][E].items():
                    r.extend(got[key])
    return {path: {E: {"ms": 1e3 * statistics.median(r["decode_s"]), "cpu_ms": 1e3 * statistics.median(r["cpu_s"])}
                   for E, r in per.items()} for path, per in raw.items()}
