"""ONNX Runtime CPU decode and prefill per weight format, against each format's weight-streaming floor.

For one preset (random weights, seed 0) the same network is built in each form: MXFP4-packed experts (K3's
format, run by the k3::MoEMXFP4 kernel when the ONNX Runtime kernel library is built: `k3x build-ort-kernels`)
with the fp32 trunk ("mxfp4"), the bf16 trunk ("mxfp4+bf16") and the int8 trunk ("mxfp4+int8": the dense
projections' weights rounded / quantised from the same fp32 weights, model/trunk.py), and the experts decoded
to fp32 with the fp32 trunk ("dense"). Each is exported as the `ort` flavor and run through the batch interface
(what `k3x run`, `verify` and the GenAI package use) at each depth P:
  - prefill: one call on a [1, P] prompt from an empty state -> tokens/s (median over the rounds)
  - decode: --decode-steps one-token calls after that prompt -> ms/token (median), and the CPU time the
    process spent per call (all threads: less sensitive than wall time to other processes on the cores)
  - floor: the time to stream the bytes one decode step must read (every weight but the embedding table and
    the routed experts, plus top_k experts per MoE layer, each in its form's bytes) once: a sum over a buffer
    of that size on 2 MB pages, on the same threads, right after each decode step; `floor_share` = the median
    of floor / decode over those pairs (1 = at it), `floor GB/s` the rate the machine streamed at.
  Each form runs in a process of its own, the forms one after another in each of --repeats rounds (`measure`).
  - experts: a decode step of one MoE node alone (x, z of one token) with 16, 64 and 256 experts of the same
    top_k, kernel (when built) and function body: its cost must follow the active experts, not the total.
Prints a table and writes --json. The machine's load average is recorded beside the figures.

    python bench/cpu_decode.py [--preset k3-bench] [--depths 128,2048] [--decode-steps 16] [--threads N]
                               [--formats mxfp4,mxfp4+bf16,mxfp4+int8,dense] [--repeats 2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def same_weights(packed_model, cfg):
    """A dense-expert model holding `packed_model`'s weights, its experts decoded to fp32."""
    from k3x.custom_ops.moe_mxfp4.codec import dequantize
    from k3x.model import build_model
    from k3x.model.options import BuildOptions

    dense = build_model(cfg, BuildOptions(expert_format="dense"), seed=None)
    state = packed_model.state_dict()
    out = {}
    for name in dense.state_dict():  # a routed expert's packed bytes (uint8, beside their scales) decoded
        packed = name + "_scale" in state
        out[name] = dequantize(state[name], state[name + "_scale"]) if packed else state[name]
    dense.load_state_dict(out)
    return dense.eval()


def stream_ms(buf, nbytes: int) -> float:
    """The time to read `nbytes` of `buf` (fp32, torch's threads) once: a sum over them, ms."""
    part = buf[:max(1, nbytes // 4)]
    t = time.perf_counter()
    part.sum()
    return 1e3 * (time.perf_counter() - t)


def step_bytes(model, cfg) -> int:
    """The bytes a decode step reads: every parameter but the embedding table and the routed experts, plus
    top_k experts of every MoE layer (packed: their nibbles and scale bytes)."""
    total = 0
    for name, p in list(model.named_parameters()) + list(model.named_buffers()):
        if "embed_tokens" in name or any(name.endswith(f".experts.{w}") or name.endswith(f".experts.{w}_scale")
                                         for w in ("w1", "w3", "w2")):
            continue
        total += p.numel() * p.element_size()
    per_expert = 0
    for name, p in model.named_parameters():
        if any(name.endswith(f".experts.{w}") or name.endswith(f".experts.{w}_scale") for w in ("w1", "w3", "w2")):
            per_expert += p[0].numel() * p.element_size()
    return total + per_expert * cfg.moe.top_k  # per_expert sums over the MoE layers already


def child_run(onnx: Path, preset_name: str, depths: list[int], steps: int, threads: int, nbytes: int) -> dict:
    """One form in this process alone (what `k3x run` gets: one session, its threads undisturbed): per depth P,
    a prefill of a [1, P] prompt (seeded by P, the same for every form) and `steps` decode steps after it, each
    followed by one floor read of `nbytes` (paired: the machine's memory bandwidth on this VM drifts between
    runs, 30 to 50 GB/s, so each step is set against a floor read under the same conditions; the parent runs
    this process with OMP_WAIT_POLICY=PASSIVE, so torch's threads sleep after the read instead of spinning on
    the cores the next step runs on). The floor's buffer is on 2 MB pages like the session's weights
    (runtime/host_memory.py). Seconds / ms as lists, for the parent's medians."""
    import torch

    from k3x.model import preset
    from k3x.runtime.host_memory import collapse
    from k3x.runtime.ort_runner import OrtRunner
    from k3x.runtime.runners import next_feeds, start_feeds

    torch.set_num_threads(threads)
    cfg = preset(preset_name)
    runner = OrtRunner(onnx, provider="cpu", intra_op_threads=threads)
    buf = torch.ones(nbytes // 4 + 1)  # written once, so its pages are real
    collapse([(buf.data_ptr(), buf.data_ptr() + 4 * buf.numel())])
    stream_ms(buf, nbytes)
    g = torch.Generator().manual_seed(0)
    warm = runner.infer(start_feeds(cfg, torch.randint(0, cfg.vocab_size, (1, 8), generator=g)))
    runner.infer(next_feeds(cfg, warm, warm["logits"][:, -1].argmax(-1, keepdim=True)))  # first-call allocations
    out = {}
    for P in depths:
        prompt = torch.randint(0, cfg.vocab_size, (1, P), generator=torch.Generator().manual_seed(P))
        t = time.perf_counter()
        res = runner.infer(start_feeds(cfg, prompt))
        f = {"prefill_s": time.perf_counter() - t, "decode_s": [], "cpu_s": [], "floor_ms": []}
        for _ in range(steps):
            feeds = next_feeds(cfg, res, res["logits"][:, -1].argmax(-1, keepdim=True))
            t, c = time.perf_counter(), time.process_time()
            res = runner.infer(feeds)
            f["decode_s"].append(time.perf_counter() - t)
            f["cpu_s"].append(time.process_time() - c)
            f["floor_ms"].append(stream_ms(buf, nbytes))
        out[P] = f
    return out


def measure(files: dict[str, Path], nbytes: dict[str, int], preset_name: str, depths: list[int], steps: int,
            rounds: int, threads: int) -> dict:
    """Per form and depth P: prefill tok/s and decode ms/token (medians over `rounds`) and the floor of the
    form's step bytes. Each form runs in a process of its own (`--child`), one after another, round after
    round: two sessions in one process left each other's intra-op threads spinning on the cores the other
    one ran on (a decode step twice as long as `k3x run`'s); alternating the forms per round weighs a load
    that changes over the run on each alike."""
    raw: dict[str, dict[int, dict[str, list]]] = {f: {P: {} for P in depths} for f in files}
    for _ in range(rounds):
        for form, onnx in files.items():
            with tempfile.NamedTemporaryFile(suffix=".json") as res:
                subprocess.run([sys.executable, __file__, "--child", str(onnx), "--preset", preset_name,
                                "--depths", ",".join(map(str, depths)), "--decode-steps", str(steps), "--threads",
                                str(threads), "--child-bytes", str(nbytes[form]), "--json", res.name], check=True,
                               env={**os.environ, "OMP_WAIT_POLICY": "PASSIVE"})
                got = json.loads(Path(res.name).read_text())
            for P in depths:
                for key, v in got[str(P)].items():
                    raw[form][P].setdefault(key, []).extend(v if isinstance(v, list) else [v])
    out: dict[str, dict[int, dict]] = {}
    for form in files:
        out[form] = {}
        for P in depths:
            r = raw[form][P]
            ms, fl = 1e3 * statistics.median(r["decode_s"]), statistics.median(r["floor_ms"])
            share = statistics.median([f / (1e3 * d) for f, d in zip(r["floor_ms"], r["decode_s"])])  # paired
            out[form][P] = {"prefill_tokens_per_s": P / statistics.median(r["prefill_s"]), "decode_ms_per_token": ms,
                            "decode_cpu_ms_per_token": 1e3 * statistics.median(r["cpu_s"]), "floor_ms": fl,
                            "floor_share": share}
    return out


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


def expert_scaling(counts: list[int], top_k: int, d: int, L: int, I: int, library, repeats: int = 50) -> dict:
    """A one-token MoE node (`moe_node`) with each expert count, median CPU ms per call (one thread): on the
    kernel (when built) and on the function body."""
    import numpy as np
    import onnxruntime as ort
    import torch

    out: dict[str, dict[int, float]] = {}
    for name, lib in (("kernel", library), ("body", None)):
        if name == "kernel" and lib is None:
            continue
        out[name] = {}
        for E in counts:
            so = ort.SessionOptions()
            so.intra_op_num_threads = 1
            if lib is not None:
                so.register_custom_ops_library(str(lib))
            sess = ort.InferenceSession(moe_node(E, top_k, d, L, I).SerializeToString(), so,
                                        providers=["CPUExecutionProvider"])
            g = torch.Generator().manual_seed(1)
            times = []
            for i in range(repeats + 3):
                feeds = {"x": torch.randn(1, d, generator=g).numpy(), "z": torch.randn(1, L, generator=g).numpy()}
                t = time.thread_time()  # one intra-op thread: the node runs on this one
                sess.run(None, feeds)
                if i >= 3:
                    times.append(time.thread_time() - t)
            out[name][E] = 1e3 * float(np.median(times))
    return out


FORMS = {  # form -> (expert format, trunk)
    "mxfp4": ("mxfp4", "dense"), "mxfp4+bf16": ("mxfp4", "bf16"), "mxfp4+int8": ("mxfp4", "int8"),
    "dense": ("dense", "dense"),
}


def form_model(form: str, packed, cfg):
    """The network of `form`, every weight `packed`'s (the trunks rounded / quantised from its fp32 weights)."""
    import copy

    from k3x.model.trunk import convert_trunk

    experts, trunk = FORMS[form]
    if experts == "dense":
        return same_weights(packed, cfg)
    return convert_trunk(copy.deepcopy(packed), trunk)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="k3-bench")
    ap.add_argument("--depths", default="128,2048")
    ap.add_argument("--formats", default=",".join(FORMS), help=f"of {list(FORMS)}")
    ap.add_argument("--decode-steps", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=2, help="rounds, each running every form once")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--json", type=Path, default=Path("bench_cpu_decode.json"))
    ap.add_argument("--child", type=Path, help=argparse.SUPPRESS)  # one form's model.onnx, measured alone
    ap.add_argument("--child-bytes", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    depths = [int(p) for p in args.depths.split(",") if p.strip()]
    if args.child is not None:
        res = child_run(args.child, args.preset, depths, args.decode_steps, args.threads, args.child_bytes)
        args.json.write_text(json.dumps(res))
        return

    import torch

    from k3x.exporter.onnx import OnnxOptions, export_onnx
    from k3x.exporter.trace import trace
    from k3x.model import build_model, preset
    from k3x.model.options import BuildOptions
    from k3x.runtime.ort_kernels import library

    torch.set_num_threads(args.threads)
    cfg = preset(args.preset)
    formats = [f.strip() for f in args.formats.split(",") if f.strip()]
    if set(formats) - set(FORMS):
        ap.error(f"--formats: {sorted(set(formats) - set(FORMS))} not in {list(FORMS)}")
    packed = build_model(cfg, BuildOptions(expert_format="mxfp4"), seed=0)
    load = {"before": os.getloadavg()[0]}
    with tempfile.TemporaryDirectory(prefix="k3x-cpu-decode-") as tmp:
        files, nbytes = {}, {}
        for form in formats:
            model = form_model(form, packed, cfg)
            nbytes[form] = step_bytes(model, cfg)
            (Path(tmp) / form).mkdir()
            files[form] = export_onnx(trace(model), cfg, Path(tmp) / form, OnnxOptions(flavors=("ort",))).files["ort"]
            del model
        del packed
        figures = measure(files, nbytes, args.preset, depths, args.decode_steps, args.repeats, args.threads)
    rows = {form: {"step_bytes": nbytes[form], "kernels": library() is not None, "depths": figures[form]}
            for form in formats}
    m = cfg.moe
    scaling = expert_scaling([16, 64, 256], m.top_k, cfg.hidden_size, m.latent_dim or cfg.hidden_size,
                             m.intermediate_size, library())
    load["after"] = os.getloadavg()[0]
    print(f"{args.preset}, ONNX Runtime CPU, {args.threads} threads, load average {load['before']:.1f} -> "
          f"{load['after']:.1f}, kernel library {'built' if library() else 'not built'}, one process per form")
    print(f"{'form':<10} {'depth':>6} {'prefill tok/s':>14} {'decode ms/tok':>14} {'cpu ms/tok':>11} "
          f"{'step MB':>8} {'floor ms':>9} {'floor GB/s':>10} {'floor share':>12}")
    for form, row in rows.items():
        for P, f in row["depths"].items():
            print(f"{form:<10} {P:>6} {f['prefill_tokens_per_s']:>14.1f} {f['decode_ms_per_token']:>14.2f} "
                  f"{f['decode_cpu_ms_per_token']:>11.2f} {row['step_bytes'] / 1e6:>8.1f} {f['floor_ms']:>9.2f} "
                  f"{row['step_bytes'] / 1e6 / f['floor_ms']:>10.1f} {f['floor_share']:>12.2f}")
    for name, per in scaling.items():
        spread = max(per.values()) / min(per.values())
        print(f"one MoE node, one token, {name}: " + ", ".join(f"E={E} {ms:.3f} ms" for E, ms in per.items())
              + f"  (max/min {spread:.2f})")
    args.json.write_text(json.dumps({"preset": args.preset, "threads": args.threads, "load_average": load,
                                     "formats": rows, "expert_scaling_ms": scaling}, indent=2) + "\n")
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
