"""End-to-end sections of bench/gpu_check.py, appended to its `CHECKS`:

- `parity_model_end_to_end`: k3-mini through torch.ops.k3 with the Triton kernels against the reference
  kernels, fp32, prefill then decode (the op wiring end to end);
- `serving_end_to_end`: continuous batching (runtime/serve.py) on k3-mini in fp32 with the Triton kernels
  against the same with the reference kernels, both on the GPU (tokens equal, logits within fp32 tolerance),
  and one / 32 sequences' eager decode step on k3-bench in bf16 (the batching speedup on this GPU).

Helpers (Result, _compare) come from the running gpu_check module; torch, triton and this repository only."""

from __future__ import annotations

import sys
import time


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


def _decode_step_timer(step, cfg, batch: int, past: int, block_size: int, dtype, device: str = "cuda"):
    """A function timing (ms, wall, synchronised) one eager decode step of `batch` sequences at `past`
    positions on `device`, pools random, the step's KDA rows written back in place as serve() does."""
    import torch

    from k3x.model.state import blocks_for
    from k3x.runtime.pools import StatePools

    per = blocks_for(past + 1, block_size)
    pools = StatePools(cfg, slots=batch, blocks=batch * per, block_size=block_size, dtype=dtype, device=device)
    for t in pools.tensors.values():
        t.normal_(0.0, 0.1)
    i32, gen = torch.int32, torch.Generator(device=device).manual_seed(batch)
    feeds = {"cu_seqlens": torch.arange(batch + 1, dtype=i32, device=device),
             "past_lens": torch.full((batch,), past, dtype=i32, device=device),
             "slots": torch.arange(batch, dtype=i32, device=device),
             "block_table": torch.arange(batch * per, dtype=i32, device=device).view(batch, per),
             "logits_index": torch.arange(batch, device=device)}
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    def one() -> float:
        ids = torch.randint(0, cfg.vocab_size, (batch,), generator=gen, device=device)
        sync()
        t = time.perf_counter()
        with torch.no_grad():
            _, new = step(ids, *feeds.values(), list(pools.tensors.values()))
            for (name, pool), row in zip(pools.tensors.items(), new):  # KDA rows back in place; latents dropped
                if not name.endswith(".latent"):
                    pool[:batch].copy_(row)
        sync()
        return (time.perf_counter() - t) * 1e3
    one.pools = pools  # what the steps read and write
    return one


def serve_both(kernels: tuple[str, str], device: str) -> list[list]:
    """k3-mini (fp32, seeded) serving 6 prompts of 1 to 300 tokens with different new-token counts through
    continuous batching (3 slots, 64-token steps: the long prompts prefill in chunks beside others' decode
    rows), once per kernel set of `kernels` -> each run's records (tokens and logits)."""
    import torch

    from k3x.model import build_model, preset
    from k3x.model.serving import K3ServingStep
    from k3x.runtime.serve import ServeOptions, StepModuleRunner, serve
    from k3x.text.sampling import SamplingOptions

    cfg = preset("k3-mini")
    lm = build_model(cfg, device=device, dtype=torch.float32, seed=0).eval()
    gen = torch.Generator().manual_seed(3)
    lens, news = [1, 5, 70, 130, 17, 300], [4, 8, 3, 6, 5, 2]
    prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=gen).tolist() for n in lens]
    opts = ServeOptions(max_sequences=3, block_size=16, max_step_tokens=64, keep_logits=True)
    runs = []
    for k in kernels:
        step = K3ServingStep(lm, kernels=k)
        runner = StepModuleRunner(k, step, step.input_names, step.output_names, device)
        runs.append(serve(runner, cfg, prompts, SamplingOptions(), opts, max_new_tokens=news, device=device))
    return runs


def serving_end_to_end(ctx) -> list:
    import torch

    from k3x.model import build_model, preset
    from k3x.model.serving import K3ServingStep

    gc = _gc(ctx)
    if ctx.device != "cuda":
        return [gc.Result("serving e2e triton vs reference", "info", None, note="needs CUDA (kernels=triton)")]
    out = []
    for ref, tri in zip(*serve_both(("reference", "triton"), "cuda")):
        tag = f"prompt {ref.index} ({len(ref.prompt)} tokens)"
        same = ref.tokens == tri.tokens
        r = gc._compare(f"serving e2e logits {tag}", torch.stack(tri.logits), torch.stack(ref.logits), torch.float32)
        r.metrics["tokens_equal"] = same
        r.ok = bool(r.ok and same)
        out.append(r)
    if not ctx.bench or ctx.time_left() < 20:
        return out
    bench_cfg = preset("k3-bench")
    lm = build_model(bench_cfg, device="cuda", dtype=torch.bfloat16, seed=0).eval()
    step = K3ServingStep(lm, kernels="triton")
    timers = {b: _decode_step_timer(step, bench_cfg, b, 64, 16, torch.bfloat16) for b in (1, 32)}
    ms = {b: [] for b in timers}
    for _ in range(3):  # warm-up (compiles), then interleaved repeats
        for b, t in timers.items():
            t()
    for _ in range(10):
        for b, t in timers.items():
            ms[b].append(t())
    med = {b: sorted(v)[len(v) // 2] for b, v in ms.items()}
    out.append(gc.Result("serving decode step k3-bench bf16 eager (wall)", "bench", None,
                         {"one_seq_ms": med[1], "32_seq_ms": med[32], "batching_speedup": 32 * med[1] / med[32]},
                         note="eager: host launches included (no CUDA graph)"))
    return out
