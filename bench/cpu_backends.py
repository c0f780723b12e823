"""Eager PyTorch vs ONNX Runtime (CPU provider) on k3-mini and k3-bench, side by side in one run.

For each preset (random fp32 weights): trace, export the `ort` ONNX flavor into a temp folder, then time
both backends through the same runner interface (runtime/runners.py) with the same thread count:
  - prefill: one call on a [1, P] prompt from an empty state  -> tokens/s (median of --repeats)
  - decode:  --decode-steps T=1 calls carrying state            -> ms/token (median over steps)
Prints a table and writes JSON. ONNX Runtime's MoE body loops over the experts actually picked (sorted
segments, exporter/onnx_flavors.py), copying each picked expert's weights once per call; the JSON
records E and top_k.

    python bench/cpu_backends.py [--presets k3-mini,k3-bench] [--prompt 128] [--decode-steps 32] [--threads N]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path


def time_backend(runner, cfg, prompt, decode_steps: int, repeats: int) -> dict[str, float]:
    from k3x.runtime.runners import DecodeSteps, start_feeds

    prefill = []
    for _ in range(repeats):
        t = time.perf_counter()
        out = runner.infer(start_feeds(cfg, prompt))
        prefill.append(time.perf_counter() - t)
    steps, step = [], DecodeSteps(runner, cfg)  # the decode loop of `k3x run` (runners.generate)
    for _ in range(decode_steps):
        token = out["logits"][:, -1].argmax(-1, keepdim=True)
        t = time.perf_counter()
        out = step(out, token)
        steps.append(time.perf_counter() - t)
    p = statistics.median(prefill)
    return {"prefill_s": p, "prefill_tokens_per_s": prompt.numel() / p,
            "decode_ms_per_token": 1e3 * statistics.median(steps)}


def bench_preset(name: str, args) -> dict:
    import torch

    from k3x.exporter.onnx import OnnxOptions, export_onnx
    from k3x.exporter.trace import trace
    from k3x.model import build_model, preset
    from k3x.runtime.ort_runner import OrtRunner
    from k3x.runtime.runners import ModuleRunner

    cfg = preset(name)
    model = build_model(cfg, seed=0)
    t = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="k3x-bench-") as tmp:
        art = export_onnx(trace(model), cfg, Path(tmp), OnnxOptions(flavors=("ort",)))
        export_s = time.perf_counter() - t
        runners = {"eager": ModuleRunner("eager", model, cfg),
                   "ort-cpu": OrtRunner(art.files["ort"], provider="cpu", intra_op_threads=args.threads)}
        prompt = torch.randint(0, cfg.vocab_size, (1, args.prompt), generator=torch.Generator().manual_seed(0))
        for r in runners.values():  # warm-up: first-call allocations, ORT's arena, lazy inits
            time_backend(r, cfg, prompt[:, :8], 2, 1)
        results = {n: time_backend(r, cfg, prompt, args.decode_steps, args.repeats) for n, r in runners.items()}
    params = sum(p.numel() for p in model.parameters())
    return {"preset": name, "parameters": params, "experts": cfg.moe.num_experts, "top_k": cfg.moe.top_k,
            "export_s": round(export_s, 1), "backends": results}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--presets", default="k3-mini,k3-bench")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--decode-steps", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--json", type=Path, default=Path("bench_cpu_backends.json"))
    args = ap.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    rows = [bench_preset(p.strip(), args) for p in args.presets.split(",") if p.strip()]
    print(f"CPU, {args.threads} threads, prompt {args.prompt}, {args.decode_steps} decode steps, fp32, batch 1")
    print(f"{'preset':<10} {'backend':<8} {'prefill tok/s':>14} {'decode ms/tok':>14} {'ort/eager speed':>16}")
    for row in rows:
        eager = row["backends"]["eager"]
        for name, r in row["backends"].items():
            speed = (f"{eager['prefill_s'] / r['prefill_s']:.2f}x / {eager['decode_ms_per_token'] / r['decode_ms_per_token']:.2f}x"
                     if name != "eager" else "")
            print(f"{row['preset']:<10} {name:<8} {r['prefill_tokens_per_s']:>14.1f} {r['decode_ms_per_token']:>14.2f} "
                  f"{speed:>16}")
    args.json.write_text(json.dumps({"threads": args.threads, "prompt": args.prompt, "rows": rows}, indent=2) + "\n")
    print(f"wrote {args.json}  (speed = eager time / ort time: prefill / decode)")


if __name__ == "__main__":
    main()
