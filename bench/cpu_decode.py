"""ONNX Runtime CPU decode and prefill per weight format, against each format's weight-streaming floor.

For one preset (random weights, seed 0) the same network is built in each form: MXFP4-packed experts (K3's
format, run by the k3::MoEMXFP4 kernel when the ONNX Runtime kernel library is built: `k3x build-ort-kernels`)
with the fp32 trunk ("mxfp4"), the bf16 trunk ("mxfp4+bf16") and the int8 trunk ("mxfp4+int8": the dense
projections' weights rounded / quantised from the same fp32 weights, model/trunk.py), and the experts decoded
to fp32 with the fp32 trunk ("dense"). Each is exported as the `ort` flavor and run through the batch interface
(what `k3x run`, `verify` and the GenAI package use) at each depth P:
  - prefill: one call on a [1, P] prompt from an empty state -> tokens/s (median over the rounds)
  - decode: --decode-steps one-token calls after that prompt, as `k3x run` makes them (runners.DecodeSteps:
    the states alternate between two sets of buffers, whose bindings the runner keeps) -> ms/token (median),
    and the CPU time the process spent per call (all threads: less sensitive than wall time to other
    processes on the cores)
  - floor: the time to stream the bytes one decode step must read (every weight but the embedding table and
    the routed experts, plus top_k experts per MoE layer, each in its form's bytes) once: a sum over a buffer
    of that size on 2 MB pages, on the same threads, right after each decode step; `floor_share` = the median
    of floor / decode over those pairs (1 = at it), `floor GB/s` the rate the machine streamed at.
  Each form runs in a process of its own, the forms one after another in each of --repeats rounds (`measure`).
  - experts (bench/expert_scaling.py): the cost must follow the active experts, not the total. A decode step
    (prompt 128, the batch interface, the same children) of the preset's MXFP4 model rebuilt with 16, 64 and
    256 experts of the same top_k, and one MoE node alone (one token, one thread, the caches evicted before
    each call), on the kernel (when built) and on the function body (K3X_ORT_KERNELS=0 in the child); max/min
    over the expert counts per path.
  - llama.cpp (--llama-cpp DIR, bench/llama_cpp.py): the same weights through llama.cpp's converter and
    llama-bench, f32 / bf16 / q8_0 trunk beside mxfp4 / mxfp4+bf16 / mxfp4+int8, each right after its k3x form
    in every round, against its own file's bytes at the rate of that form's floor reads in the round.
Prints a table and writes --json. The machine's load average is recorded beside the figures.

    python bench/cpu_decode.py [--preset k3-bench] [--depths 128,2048] [--decode-steps 16] [--threads N]
                               [--formats mxfp4,mxfp4+bf16,mxfp4+int8,dense] [--repeats 2]
                               [--experts 16,64,256] [--expert-threads 1] [--expert-steps 16] [--body-steps 3]
                               [--llama-cpp DIR]
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
from dataclasses import replace
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


def child_run(onnx: Path, preset_name: str, depths: list[int], steps: int, threads: int, nbytes: int,
              experts: int | None = None) -> dict:
    """One form in this process alone (what `k3x run` gets: one session, its threads undisturbed): per depth P,
    a prefill of a [1, P] prompt (seeded by P, the same for every form) and `steps` decode steps after it, each
    followed (when `nbytes`) by one floor read of `nbytes` (paired: the machine's memory bandwidth on this VM
    drifts between runs, 30 to 50 GB/s, so each step is set against a floor read under the same conditions; the
    parent runs this process with OMP_WAIT_POLICY=PASSIVE, so torch's threads sleep after the read instead of
    spinning on the cores the next step runs on). The floor's buffer is on 2 MB pages like the session's weights
    (runtime/host_memory.py). `experts`: the export's num_experts, when not the preset's. Seconds / ms as
    lists, for the parent's medians; "kernels": the session had the kernel library."""
    import torch

    from k3x.model import preset
    from k3x.runtime.host_memory import collapse
    from k3x.runtime.ort_kernels import library
    from k3x.runtime.ort_runner import OrtRunner
    from k3x.runtime.runners import DecodeSteps, next_feeds, start_feeds

    torch.set_num_threads(threads)
    cfg = preset(preset_name)
    if experts is not None:
        cfg = replace(cfg, moe=replace(cfg.moe, num_experts=experts))
    runner = OrtRunner(onnx, provider="cpu", intra_op_threads=threads)
    if nbytes:
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
        f = {"prefill_s": time.perf_counter() - t, "decode_s": [], "cpu_s": [], "floor_ms": [],
             "kernels": library() is not None}
        step = DecodeSteps(runner, cfg)  # the decode loop of `k3x run` (runners.generate)
        for _ in range(steps):
            token = res["logits"][:, -1].argmax(-1, keepdim=True)
            t, c = time.perf_counter(), time.process_time()
            res = step(res, token)
            f["decode_s"].append(time.perf_counter() - t)
            f["cpu_s"].append(time.process_time() - c)
            if nbytes:
                f["floor_ms"].append(stream_ms(buf, nbytes))
        out[P] = f
    return out


def run_child(onnx: Path, preset_name: str, depths: list[int], steps: int, threads: int, nbytes: int,
              experts: int | None = None, env: dict[str, str] | None = None) -> dict:
    """`child_run` in a process of its own (`--child`), `env` added to its environment (OMP_WAIT_POLICY=PASSIVE
    always: `child_run`); its figures by depth."""
    more = ["--child-experts", str(experts)] if experts is not None else []
    with tempfile.NamedTemporaryFile(suffix=".json") as res:
        subprocess.run([sys.executable, __file__, "--child", str(onnx), "--preset", preset_name, "--depths",
                        ",".join(map(str, depths)), "--decode-steps", str(steps), "--threads", str(threads),
                        "--child-bytes", str(nbytes), *more, "--json", res.name], check=True,
                       env={**os.environ, "OMP_WAIT_POLICY": "PASSIVE", **(env or {})})
        return json.loads(Path(res.name).read_text())


def measure(files: dict[str, Path], nbytes: dict[str, int], preset_name: str, depths: list[int], steps: int,
            rounds: int, threads: int, other=None, ggufs: dict[str, tuple[Path, int]] | None = None
            ) -> tuple[dict, dict]:
    """Per form and depth P: prefill tok/s and decode ms/token (medians over `rounds`) and the floor of the
    form's step bytes. Each form runs in a process of its own (`--child`), one after another, round after
    round: two sessions in one process left each other's intra-op threads spinning on the cores the other
    one ran on (a decode step twice as long as `k3x run`'s); alternating the forms per round weighs a load
    that changes over the run on each alike. `other` (bench/llama_cpp.py's LlamaCpp) with `ggufs` (form ->
    (GGUF, its step bytes)): llama.cpp on the same weights runs right after each such form in each round, its
    floor that many bytes at the rate the form's floor reads ran at in the round (one rate for both: a read
    after llama-bench, alone, ran at 30-58 GB/s); its figures are the second value returned (form -> {"outtype",
    "step_bytes", "build", "depths": per P as bench/llama_cpp.py's summary})."""
    from k3x.bench import llama_cpp

    raw: dict[str, dict[int, dict[str, list]]] = {f: {P: {} for P in depths} for f in files}
    theirs: dict[str, dict] = {f: {P: {} for P in depths} for f in ggufs or {}}
    build = "?"
    for _ in range(rounds):
        for form, onnx in files.items():
            got = run_child(onnx, preset_name, depths, steps, threads, nbytes[form])
            for P in depths:
                for key, v in got[str(P)].items():
                    raw[form][P].setdefault(key, []).extend(v if isinstance(v, list) else [v])
            if form in theirs:
                g, n = ggufs[form]
                figs, build = llama_cpp.measure_file(other, g, depths, steps, threads)
                for P in depths:
                    figs[P]["floor_ms"] = [statistics.median(got[str(P)]["floor_ms"]) * n / nbytes[form]]
                    for key, v in figs[P].items():
                        theirs[form][P].setdefault(key, []).extend(v)
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
    return out, {form: {"outtype": llama_cpp.OUTTYPES[form], "step_bytes": ggufs[form][1], "build": build,
                        "depths": llama_cpp.summary(r, depths)} for form, r in theirs.items()}


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
    ap.add_argument("--experts", default="16,64,256", help="expert counts of the scaling figures ('' skips them)")
    ap.add_argument("--expert-threads", type=int, default=1, help="threads of the scaling's decode steps")
    ap.add_argument("--expert-steps", type=int, default=16, help="decode steps per round, scaling, kernel")
    ap.add_argument("--body-steps", type=int, default=3, help="decode steps per round, scaling, function body")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--json", type=Path, default=Path("bench_cpu_decode.json"))
    ap.add_argument("--llama-cpp", type=Path, help="a built llama.cpp checkout: its rows on the same weights "
                    "beside k3x's (bench/llama_cpp.py)")
    ap.add_argument("--child", type=Path, help=argparse.SUPPRESS)  # one form's model.onnx, measured alone
    ap.add_argument("--child-bytes", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--child-experts", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    depths = [int(p) for p in args.depths.split(",") if p.strip()]
    if args.child is not None:
        res = child_run(args.child, args.preset, depths, args.decode_steps, args.threads, args.child_bytes,
                        args.child_experts)
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
    counts = [int(E) for E in args.experts.split(",") if E.strip()]
    other = None
    if args.llama_cpp is not None:  # its checkout and the preset checked before any export
        from k3x.bench.llama_cpp import OUTTYPES, LlamaCpp

        if not set(formats) & set(OUTTYPES):
            ap.error(f"--llama-cpp: its rows stand beside {list(OUTTYPES)}; --formats has none of them")
        other = LlamaCpp(args.llama_cpp, cfg)
    load = {"before": os.getloadavg()[0]}
    with tempfile.TemporaryDirectory(prefix="k3x-cpu-decode-") as tmp:
        files, nbytes = {}, {}
        packed = build_model(cfg, BuildOptions(expert_format="mxfp4"), seed=0) if formats else None
        for form in formats:
            model = form_model(form, packed, cfg)
            nbytes[form] = step_bytes(model, cfg)
            (Path(tmp) / form).mkdir()
            files[form] = export_onnx(trace(model), cfg, Path(tmp) / form, OnnxOptions(flavors=("ort",))).files["ort"]
            del model
        ggufs = agreement = None
        if other is not None:
            from k3x.bench.llama_cpp import parity, prepare

            agreement = parity(other, packed, same_weights(packed, cfg), cfg, Path(tmp), args.threads)
            print(f"llama.cpp's logits on the same fp32 weights: within {agreement['max_abs']:.2e} of k3x's over "
                  f"{agreement['positions']} positions (tolerance {agreement['tolerance']:g})", flush=True)
            ggufs = prepare(other, packed, formats, Path(tmp), cfg.moe.top_k, cfg.moe.num_experts)
        del packed
        figures, theirs = measure(files, nbytes, args.preset, depths, args.decode_steps, args.repeats, args.threads,
                                  other, ggufs)
        load["forms"] = os.getloadavg()[0]
        scaling = expert_figures(cfg, counts, Path(tmp), args) if counts else None
        load["after"] = os.getloadavg()[0]
    rows = {form: {"step_bytes": nbytes[form], "kernels": library() is not None, "depths": figures[form]}
            for form in formats}
    print(f"{args.preset}, ONNX Runtime CPU, {args.threads} threads, load average {load['before']:.1f} -> "
          f"{load['forms']:.1f}, kernel library {'built' if library() else 'not built'}, one process per form")
    if rows:
        print(f"{'form':<10} {'depth':>6} {'prefill tok/s':>14} {'decode ms/tok':>14} {'cpu ms/tok':>11} "
              f"{'step MB':>8} {'floor ms':>9} {'floor GB/s':>10} {'floor share':>12}")
    for form, row in rows.items():
        for P, f in row["depths"].items():
            print(f"{form:<10} {P:>6} {f['prefill_tokens_per_s']:>14.1f} {f['decode_ms_per_token']:>14.2f} "
                  f"{f['decode_cpu_ms_per_token']:>11.2f} {row['step_bytes'] / 1e6:>8.1f} {f['floor_ms']:>9.2f} "
                  f"{row['step_bytes'] / 1e6 / f['floor_ms']:>10.1f} {f['floor_share']:>12.2f}")
    if theirs:
        from k3x.bench.llama_cpp import print_rows

        print_rows(theirs)
    if scaling:
        print_scaling(scaling, cfg.moe.top_k, load, args.expert_threads)
    args.json.write_text(json.dumps({"preset": args.preset, "threads": args.threads, "load_average": load,
                                     "formats": rows, "llama_cpp": theirs or None, "llama_cpp_parity": agreement,
                                     "expert_scaling": scaling}, indent=2) + "\n")
    print(f"wrote {args.json}")


def expert_figures(cfg, counts: list[int], tmp: Path, args) -> dict:
    """bench/expert_scaling.py's step and node figures per path and expert count, and their spreads (max/min)."""
    from k3x.bench.expert_scaling import expert_exports, node_scaling, spread, step_scaling
    from k3x.runtime.ort_kernels import library

    def run(onnx: Path, experts: int, steps: int, env: dict[str, str]) -> dict:
        return run_child(onnx, args.preset, [128], steps, args.expert_threads, 0, experts, env)["128"]

    files = expert_exports(cfg, counts, tmp)
    steps = {"kernel": args.expert_steps, "body": args.body_steps} if library() else {"body": args.body_steps}
    step = step_scaling(files, run, steps, args.repeats)
    m = cfg.moe
    node = node_scaling(counts, m.top_k, cfg.hidden_size, m.latent_dim or cfg.hidden_size, m.intermediate_size,
                        library())
    return {"counts": counts, "threads": args.expert_threads, "step": step, "node_ms": node,
            "step_spread": {p: {k: spread({E: f[k] for E, f in per.items()}) for k in ("ms", "cpu_ms")}
                            for p, per in step.items()},
            "node_spread": {p: spread(per) for p, per in node.items()}}


def print_scaling(s: dict, top_k: int, load: dict, threads: int) -> None:
    print(f"expert scaling, top_k {top_k}, load average {load['forms']:.1f} -> {load['after']:.1f}: a decode step "
          f"(prompt 128, batch interface, {threads} thread(s)) and one MoE node (one token, one thread, caches "
          "evicted)")
    print(f"{'path':<7} {'experts':>8} {'step ms':>8} {'step cpu ms':>12} {'node ms':>8}")
    for path, per in s["step"].items():
        for E, f in per.items():
            print(f"{path:<7} {E:>8} {f['ms']:>8.2f} {f['cpu_ms']:>12.2f} {s['node_ms'][path][E]:>8.3f}")
        sp = s["step_spread"][path]
        print(f"{path:<7} {'max/min':>8} {sp['ms']:>8.2f} {sp['cpu_ms']:>12.2f} {s['node_spread'][path]:>8.2f}")


if __name__ == "__main__":
    main()
