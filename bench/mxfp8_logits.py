"""MXFP8 activations into the MXFP4 experts (W4A8) vs bf16 ones (the activations as computed): the logits gap on
the same weights.

For each --preset: one model with MXFP4-packed experts from a seeded random init (fp32 elsewhere), run eagerly with
the reference ops twice on the same weights — `activations="bf16"` and `activations="mxfp8"` (both expert-GEMM
inputs rounded through OCP MXFP8: E4M3, one E8M0 scale per 32 along K) — over --prompts random prompts of --length
tokens (one prefill each). Reports the max and mean |Δlogit| (and the max relative to the largest |logit|), the
top-1 agreement over every position and over the last positions, and, for scale, the op-level error: the relative
RMS gap ‖u_mxfp8 − u_bf16‖ / ‖u_bf16‖ of each MoE layer's routed output on the very inputs the bf16 run fed it
(E4M3 keeps 3 mantissa bits: a few % per GEMM input). A random-init network amplifies any such perturbation
(an equal-size Gaussian one on each routed output moves its logits about as much), so the logit figures are an
upper bound for a QAT-trained K3. Prints a table and writes JSON (--json).

    python -m k3x.bench.mxfp8_logits [--preset k3-mini --preset k3-bench] [--prompts 4] [--length 32] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


def routed_inputs(model) -> list[tuple]:
    """Record every routed-MoE call's (module, xf, z) of `model`'s next runs (wraps `LatentMoE.routed`)."""
    from k3x.model.moe import LatentMoE

    calls: list[tuple] = []
    for m in model.modules():
        if isinstance(m, LatentMoE):
            def record(xf, z, expert_offset=None, m=m, routed=m.routed):
                calls.append((m, xf, z))
                return routed(xf, z, expert_offset)
            m.routed = record
    return calls


def op_error(calls: list[tuple]) -> float:
    """Max over the recorded MoE calls of ‖u_mxfp8 − u_bf16‖ / ‖u_bf16‖ on the same inputs."""
    from k3x.custom_ops.moe_mxfp4 import reference

    worst = 0.0
    for m, xf, z in calls:
        e, g = m.experts, m.gate
        args = (xf, z, g.weight, g.e_score_correction_bias, e.w1, e.w3, e.w2, e.w1_scale, e.w3_scale, e.w2_scale,
                *m.options.args())
        u, q = reference.moe(*args), reference.moe(*args, activations="mxfp8")
        worst = max(worst, ((q - u).norm() / u.norm()).item())
    return worst


def compare(name: str, *, prompts: int, length: int, seed: int) -> dict:
    """The logits of `name` with bf16 vs mxfp8 expert activations on the same weights and prompts."""
    import torch

    from k3x.model import build_model, preset
    from k3x.model.options import BuildOptions
    from k3x.runtime.runners import ModuleRunner, start_feeds

    cfg = preset(name)
    base = build_model(cfg, BuildOptions(expert_format="mxfp4"), seed=seed)
    w4a8 = build_model(cfg, BuildOptions(expert_format="mxfp4", activations="mxfp8"), seed=None)
    w4a8.load_state_dict(base.state_dict(), strict=True)  # the same weights: only the activation format differs
    ids = torch.randint(0, cfg.vocab_size, (prompts, length), generator=torch.Generator().manual_seed(seed))
    t = time.perf_counter()
    calls = routed_inputs(base)
    a = ModuleRunner("bf16", base, cfg).infer(start_feeds(cfg, ids))["logits"].double()
    b = ModuleRunner("mxfp8", w4a8, cfg).infer(start_feeds(cfg, ids))["logits"].double()
    diff = (a - b).abs()
    same = a.argmax(-1) == b.argmax(-1)  # [prompts, length]
    return {"preset": name, "prompts": prompts, "length": length, "seed": seed,
            "max_abs_diff": diff.max().item(), "mean_abs_diff": diff.mean().item(),
            "max_rel_diff": (diff.max() / a.abs().max()).item(), "logit_std": a.std().item(),
            "top1_agreement": same.double().mean().item(), "top1_agreement_last": same[:, -1].double().mean().item(),
            "moe_op_rel_err_max": op_error(calls), "seconds": time.perf_counter() - t}


def table(rows: list[dict]) -> str:
    head = (f"{'preset':<10} {'prompts×len':>11} {'max|Δ|':>9} {'mean|Δ|':>9} {'max|Δ|/max|l|':>13} {'std(l)':>8} "
            f"{'top-1 all':>9} {'top-1 last':>10} {'MoE op rel':>10}")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['preset']:<10} {r['prompts']:>5}×{r['length']:<5} {r['max_abs_diff']:>9.4f} "
                     f"{r['mean_abs_diff']:>9.5f} {r['max_rel_diff']:>13.4%} {r['logit_std']:>8.4f} "
                     f"{r['top1_agreement']:>9.1%} {r['top1_agreement_last']:>10.1%} {r['moe_op_rel_err_max']:>10.2%}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", action="append", help="repeatable (default: k3-mini and k3-bench)")
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--length", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path)
    a = p.parse_args(argv)
    rows = [compare(n, prompts=a.prompts, length=a.length, seed=a.seed) for n in a.preset or ["k3-mini", "k3-bench"]]
    print("MXFP8 vs bf16 expert activations, same MXFP4 weights (random init), eager reference ops, fp32 elsewhere:")
    print(table(rows))
    if a.json:
        a.json.write_text(json.dumps(rows, indent=1) + "\n")
    return rows


if __name__ == "__main__":
    main()
