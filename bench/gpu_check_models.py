"""End-to-end sections of bench/gpu_check.py, appended to its `CHECKS`:

- `parity_model_end_to_end`: k3-mini through torch.ops.k3 with the Triton kernels against the reference
  kernels, fp32, prefill then decode (the op wiring end to end);
- `serving_end_to_end`: continuous batching (runtime/serve.py) on k3-mini in fp32 with the Triton kernels
  against the same with the reference kernels, both on the GPU (tokens equal, logits within fp32 tolerance);
  with the Triton kernels, the prefix cache and speculative decoding (n-gram and model drafts) give the plain
  run's tokens; and one / 32 sequences' eager decode step on k3-bench in bf16 (the batching speedup here).

Helpers (Result, _compare) come from the running gpu_check module; torch, triton and this repository only."""

from __future__ import annotations

import sys


def _gc(ctx):
    return sys.modules[type(ctx).__module__]  # bench/gpu_check.py, run as __main__ or imported


def parity_model_end_to_end(ctx) -> list:
    """k3-mini through torch.ops.k3 with kernels=triton vs kernels=reference, same fp32 weights: a 70-token
    prefill (two KDA chunks) then 8 greedy decode steps carrying state, every logit compared at fp32
    tolerance (bf16 accuracy is the per-kernel checks' job; this one proves the op wiring end to end)."""

    import torch

    from k3x.model import build_model, empty_state, preset
    from k3x.model.options import BuildOptions
    from k3x.plan.kernels import Kernels

    gc = _gc(ctx)
    if ctx.device != "cuda":
        return [gc.Result("model e2e triton vs reference", "info", None, note="needs CUDA (kernels=triton)")]
    cfg = preset("k3-mini")
    dtype = torch.float32
    ref = build_model(cfg, device="cuda", dtype=dtype, seed=0)
    tri = build_model(cfg, BuildOptions(Kernels.TRITON), device="cuda", dtype=dtype, seed=0)
    ids = torch.randint(0, cfg.vocab_size, (2, 70), device="cuda")
    out = []
    with torch.no_grad():
        s_ref, s_tri = empty_state(cfg, 2, dtype, "cuda"), empty_state(cfg, 2, dtype, "cuda")
        for step in range(9):
            l_ref, s_ref = ref(ids, s_ref)
            l_tri, s_tri = tri(ids, s_tri)
            name = f"model e2e logits {'prefill' if step == 0 else f'decode {step}'}"
            out.append(gc._compare(name, l_tri, l_ref, dtype))
            ids = l_ref[:, -1:].argmax(-1)  # both follow the reference trajectory
    return out


VARIANTS = ("plain", "prefix cache", "ngram drafts", "model drafts")


def serving_runs(kernels: str, device: str, variants=VARIANTS) -> dict[str, list]:
    """k3-mini (fp32, seeded) serving 9 prompts through continuous batching (3 slots, 64-token steps: long
    prompts prefill in chunks beside others' decode rows) with `kernels`, once per variant -> records by variant.
    Prompts: 1 to 300 random tokens, two that share 64 and 96 tokens with the 300-token one (prefix-cache hits
    once it has run), one periodic (n-gram drafts: proposed, and rejected by a random model). Variants: plain;
    the prefix cache; speculative decoding with n-gram drafts; with a model drafter (the same model on its own
    pools: drafts accepted, KDA rows saved and rolled back). Greedy: every variant must give the plain tokens."""
    import torch

    from k3x.model import build_model, preset
    from k3x.model.serving import K3ServingStep
    from k3x.runtime.serve import ServeOptions, StepModuleRunner, serve
    from k3x.runtime.speculate import ModelDrafter, NgramDrafter
    from k3x.text.sampling import SamplingOptions

    cfg = preset("k3-mini")
    lm = build_model(cfg, device=device, dtype=torch.float32, seed=0).eval()
    gen = torch.Generator().manual_seed(3)
    rand = lambda n: torch.randint(0, cfg.vocab_size, (n,), generator=gen).tolist()  # noqa: E731
    prompts = [rand(n) for n in (1, 5, 70, 130, 17, 300)]
    prompts += [prompts[5][:64] + rand(20), prompts[5][:96] + rand(3), [7, 8, 9, 10] * 12]
    news = [4, 8, 3, 6, 5, 2, 5, 4, 9]

    def runner():
        step = K3ServingStep(lm, kernels=kernels)
        return StepModuleRunner(kernels, step, step.input_names, step.output_names, device)

    def run(variant: str) -> list:
        opts = ServeOptions(max_sequences=3, block_size=16, max_step_tokens=64, keep_logits=variant == "plain",
                            prefix_cache=variant == "prefix cache")
        drafter = {"ngram drafts": lambda: NgramDrafter(4),
                   "model drafts": lambda: ModelDrafter(runner(), cfg, 3, block_size=16, device=device)}.get(variant)
        return serve(runner(), cfg, prompts, SamplingOptions(), opts, max_new_tokens=news, device=device,
                     drafter=drafter() if drafter else None)
    return {v: run(v) for v in variants}


def serving_end_to_end(ctx) -> list:
    import torch

    from k3x.bench.serving_steps import StepCase
    from k3x.model import build_model, preset
    from k3x.model.serving import K3ServingStep
    from k3x.runtime.serve import StepModuleRunner

    gc = _gc(ctx)
    if ctx.device != "cuda":
        return [gc.Result("serving e2e triton vs reference", "info", None, note="needs CUDA (kernels=triton)")]
    out = []
    ref = serving_runs("reference", "cuda", ("plain",))["plain"]
    tri = serving_runs("triton", "cuda")
    for r, t in zip(ref, tri["plain"]):
        res = gc._compare(f"serving e2e logits prompt {r.index} ({len(r.prompt)} tokens)", torch.stack(t.logits),
                          torch.stack(r.logits), torch.float32)
        res.metrics["tokens_equal"] = r.tokens == t.tokens
        res.ok = bool(res.ok and r.tokens == t.tokens)
        out.append(res)
    for variant in VARIANTS[1:]:
        same = [a.tokens == b.tokens for a, b in zip(tri["plain"], tri[variant])]
        m = {"prompts_equal": sum(same), "prompts": len(same), "cached_tokens": sum(x.cached for x in tri[variant]),
             "drafts": sum(x.counts.drafted for x in tri[variant]),
             "accepted_drafts": sum(x.counts.accepted for x in tri[variant]),
             "steps": sum(x.counts.steps for x in tri[variant])}
        out.append(gc.Result(f"serving e2e {variant} = plain tokens (triton)", "parity", all(same), m))
    if not ctx.bench or ctx.time_left() < 20:
        return out
    bench_cfg = preset("k3-bench")
    lm = build_model(bench_cfg, device="cuda", dtype=torch.bfloat16, seed=0).eval()
    step = K3ServingStep(lm, kernels="triton")
    runner = StepModuleRunner("triton", step, step.input_names, step.output_names, "cuda")
    timers = {b: StepCase(bench_cfg, batch=b, positions=65, capacity=65, block_size=16, dtype=torch.bfloat16,
                          device="cuda").timer(runner, 1, 64) for b in (1, 32)}
    ms = {b: [] for b in timers}
    for _ in range(3):  # warm-up (compiles), then interleaved repeats
        for b, t in timers.items():
            t()
    for _ in range(10):
        for b, t in timers.items():
            ms[b].append(t() * 1e3)
    med = {b: sorted(v)[len(v) // 2] for b, v in ms.items()}
    out.append(gc.Result("serving decode step k3-bench bf16 eager (wall)", "bench", None,
                         {"one_seq_ms": med[1], "32_seq_ms": med[32], "batching_speedup": 32 * med[1] / med[32]},
                         note="eager: host launches included (no CUDA graph)"))
    return out
