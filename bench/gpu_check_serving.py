"""Serving-step sections of bench/gpu_check.py, appended to its `CHECKS`:

- `parity_serving`: the packed / paged kernels (k3::kda_packed, k3::kda_prep, k3::mla_paged) on K3's head
  shapes in bf16 against their references on the same inputs upcast to fp64, on packed steps that mix decode
  rows and prefill chunks of awkward lengths, slots and blocks in random order;
- `bench_serving`: their device time at decode (KDA's state bytes and MLA's latent bytes against the copy
  ceiling, MLA's FLOPs too) and on mixed and prefill steps.
The serving step end to end (continuous batching) is gpu_check_models.py's. Helpers (Result, _compare,
device_time) come from the running gpu_check module; torch, triton and this repository only (no onnx on the
import path)."""

from __future__ import annotations

import sys

MLA = {"H": 96, "C": 512, "R": 64, "BS": 64}  # K3's gated MLA: heads, kv_lora_rank, rope dim; a serving block size
KDA = {"H": 96, "K": 128, "V": 128, "W": 4}  # K3's KDA: heads, head dims, short-conv width


def _gc(ctx):
    return sys.modules[type(ctx).__module__]  # bench/gpu_check.py, run as __main__ or imported


def _cu_seqlens(lens: list[int], device: str):
    """[0, lens[0], lens[0] + lens[1], ...] int32: where each packed sequence starts, and the end."""
    import torch

    return torch.tensor([0, *lens], dtype=torch.int32, device=device).cumsum(0, dtype=torch.int32)


def _packing(lens: list[int], spare: int, device: str, gen):
    """cu_seqlens [B+1] and slots [B] (a random choice from a pool of B + spare rows), int32."""
    import torch

    slots = torch.randperm(len(lens) + spare, generator=gen)[: len(lens)].to(torch.int32)
    return _cu_seqlens(lens, device), slots.to(device)


def kda_packed_inputs(lens: list[int], H: int, K: int, V: int, dtype, device: str, seed: int = 0):
    """k3::kda_packed's inputs: q, k (unit rows), v, g in [-5, 0), beta, an fp32 pool of B + 3 rows, cu_seqlens,
    slots."""
    import torch

    from k3x.custom_ops.kda.reference import l2norm

    gen = torch.Generator().manual_seed(seed)
    N, S = sum(lens), len(lens) + 3
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    q, k = (l2norm(r(N, H, K)).to(dtype).to(device) for _ in range(2))
    v = r(N, H, V).to(dtype).to(device)
    g = (-5.0 * torch.rand(N, H, K, generator=gen)).to(device)
    beta = torch.rand(N, H, generator=gen).to(dtype).to(device)
    pool = (r(S, H, K, V) * 0.3).to(device)
    return (q, k, v, g, beta, pool, *_packing(lens, 3, device, gen))


def kda_prep_inputs(lens: list[int], H: int, K: int, V: int, W: int, dtype, device: str, seed: int = 0):
    """k3::kda_prep's inputs: qkv (rows scaled over two orders of magnitude), f, b, conv_weight, A_log, dt_bias,
    an fp32 conv pool of B + 3 rows, cu_seqlens, slots."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    N, C = sum(lens), 2 * H * K + H * V
    r = lambda *s, a=1.0: torch.randn(*s, generator=gen) * a  # noqa: E731
    qkv = (r(N, C) * torch.exp(r(N, 1, a=1.2))).to(dtype)
    f, b = r(N, H, K, a=2.0).to(dtype), r(N, H).to(dtype)
    params = (r(C, W, a=0.5).to(dtype), r(H, a=0.5), r(H * K), r(len(lens) + 3, C, W - 1, a=3.0))
    return (*(x.to(device) for x in (qkv, f, b, *params)), *_packing(lens, 3, device, gen))


def mla_paged_inputs(seqs: list[tuple[int, int]], H: int, C: int, R: int, BS: int, dtype, device: str, seed: int = 0):
    """k3::mla_paged's inputs for sequences of (past, rows): q_latent, q_rope, latent, a pool whose blocks are
    handed out in random order (two spare blocks), block_table, past_lens, cu_seqlens."""
    import torch

    from k3x.model.state import blocks_for

    gen = torch.Generator(device=device).manual_seed(seed)
    need = [blocks_for(p + t, BS) for p, t in seqs]
    N, L, NB = sum(t for _, t in seqs), C + R, sum(need) + 2
    r = lambda *s: torch.randn(*s, generator=gen, device=device)  # noqa: E731
    order = torch.randperm(NB, generator=gen, device=device).to(torch.int32)
    table = torch.zeros(len(seqs), max(need), dtype=torch.int32, device=device)
    used = 0
    for b, n in enumerate(need):
        table[b, :n] = order[used: used + n]
        used += n
    past = torch.tensor([p for p, _ in seqs], dtype=torch.int32, device=device)
    return (r(N, H, C).to(dtype), r(N, H, R).to(dtype), r(N, L).to(dtype), r(NB, BS, L).to(dtype), table, past,
            _cu_seqlens([t for _, t in seqs], device))


def _wide(x, dtype):
    return x.to(dtype) if x.is_floating_point() else x


def parity_serving(ctx) -> list:
    import torch

    from k3x.custom_ops.kda_packed import reference as kp_ref, triton as kp
    from k3x.custom_ops.kda_prep import reference as pr_ref, triton as pr
    from k3x.custom_ops.mla_paged import reference as mla_ref, triton as mla

    gc, out, dev, dt = _gc(ctx), [], ctx.device, ctx.dtype
    small = ctx.selftest
    H, K, V, W = (2, 16, 16, 4) if small else (KDA["H"], KDA["K"], KDA["V"], KDA["W"])
    steps = ([[1, 1, 70, 1, 5], [1] * 6] if small
             else [[1, 1, 200, 1, 77, 1000, 1], [1] * 64])
    for lens in steps:
        tag = f"B{len(lens)}-N{sum(lens)}-H{H}"
        if ctx.time_left() < 5:
            out.append(gc.Result(f"serving parity {tag}", "info", None, note="skipped: section budget"))
            break
        a = kda_packed_inputs(lens, H, K, V, dt, dev, seed=len(lens))
        o, s = kp.kda_packed(*a, gate_lower_bound=-5.0)
        ro, rs = kp_ref.kda_packed(*(_wide(x, torch.float64) for x in a))
        out.append(gc._compare(f"kda_packed o {tag}", o, ro, dt))
        out.append(gc._compare(f"kda_packed state {tag}", s, rs, dt))
        p = kda_prep_inputs(lens, H, K, V, W, dt, dev, seed=len(lens))
        got = pr.kda_prep(*p, gate_lower_bound=-5.0)
        want = pr_ref.kda_prep(*(_wide(x, torch.float64) for x in p), gate_lower_bound=-5.0)
        for name, x, e in zip(("q", "k", "v", "g", "beta", "new_conv"), got, want):
            out.append(gc._compare(f"kda_prep {name} {tag}", x, e, dt if name in ("q", "k", "v") else torch.float32))
        del a, p, got, want
    mH, C, R, BS = (3, 24, 8, 4) if small else (MLA["H"], MLA["C"], MLA["R"], MLA["BS"])
    cases = ([[(0, 1), (1, 1), (3, 1), (4, 1), (300, 1)], [(0, 37), (9, 1), (5, 18)]] if small else
             [[(0, 1), (1, 1), (63, 1), (64, 1), (65, 1), (1000, 1), (4097, 1), (20000, 1)],
              [(0, 300), (1000, 1), (70, 129), (5, 1), (6000, 64)]])
    for seqs in cases:
        tag = f"B{len(seqs)}-N{sum(t for _, t in seqs)}-H{mH}-C{C}-R{R}-BS{BS}"
        if ctx.time_left() < 5:
            out.append(gc.Result(f"mla_paged {tag}", "info", None, note="skipped: section budget"))
            break
        a = mla_paged_inputs(seqs, mH, C, R, BS, dt, dev, seed=len(seqs))
        scale = (C + R) ** -0.5
        got = mla.mla_paged(*a, scale=scale)
        want = mla_ref.mla_paged(*(_wide(x, torch.float64) for x in a), scale)
        variant = "decode" if all(t == 1 for _, t in seqs) else "rows"
        out.append(gc._compare(f"mla_paged {variant} {tag}", got, want, dt))
    return out


def bench_serving(ctx) -> list:
    """Device time of the serving kernels at K3's shapes in bf16: KDA decode (the fp32 state read and written,
    against the copy ceiling) and a mixed step (one 4096-token chunk and 31 decode rows beside the chunk
    alone); MLA decode at 1 K to 1 M positions of past (the latent bytes read, B * past * (C + R) * 2, against
    the copy ceiling, and the FLOPs: with 96 heads absorbed decode does 2 * 96 * (2C + R) per key, ~180 per
    latent byte, so it is bound by the tensor cores, not the copy) and a 4096-token prefill chunk."""
    import torch

    from k3x.custom_ops.kda_packed import triton as kp
    from k3x.custom_ops.kda_prep import triton as pr
    from k3x.custom_ops.mla_paged import triton as mla

    gc = _gc(ctx)
    if not ctx.bench:
        return []
    out, bf16 = [], torch.bfloat16
    kH, K, V, W = KDA["H"], KDA["K"], KDA["V"], KDA["W"]
    for B in (1, 32) if ctx.quick else (1, 32, 64):
        if ctx.time_left() < 5:
            out.append(gc.Result(f"kda_packed decode B{B}", "info", None, note="skipped: section budget"))
            continue
        a = kda_packed_inputs([1] * B, kH, K, V, bf16, "cuda")
        ms, how = gc.device_time(lambda: kp.kda_packed(*a, gate_lower_bound=-5.0))
        p = kda_prep_inputs([1] * B, kH, K, V, W, bf16, "cuda")
        pms, _ = gc.device_time(lambda: pr.kda_prep(*p, gate_lower_bound=-5.0))
        m = {"packed_us": ms * 1e3, "prep_us": pms * 1e3, "timing": how,
             "state_TB/s": 2 * B * kH * K * V * 4 / ms / 1e9}
        if ctx.copy_tbps:
            m["frac_of_copy"] = m["state_TB/s"] / ctx.copy_tbps
        out.append(gc.Result(f"kda_packed decode B{B}", "bench", None, m))
    if ctx.time_left() >= 10:
        alone = kda_packed_inputs([4096], kH, K, V, bf16, "cuda")
        mixed = kda_packed_inputs([4096] + [1] * 31, kH, K, V, bf16, "cuda")
        m = {"chunk_alone_ms": gc.device_time_within(lambda: kp.kda_packed(*alone, gate_lower_bound=-5.0))[0],
             "with_31_decode_rows_ms": gc.device_time_within(lambda: kp.kda_packed(*mixed, gate_lower_bound=-5.0))[0]}
        out.append(gc.Result("kda_packed mixed step T4096+31x1", "bench", None, m))
    H, C, R, BS = MLA["H"], MLA["C"], MLA["R"], MLA["BS"]
    per_key = 2 * H * (2 * C + R)  # FLOPs per (query, key): scores over C + R, values over C
    decode = [(1, 1024), (32, 16384), (1, 1048576), (1, 65536), (32, 1024), (32, 65536)]
    for B, past in decode[:3] if ctx.quick else decode:
        name = f"mla_paged decode B{B}-past{past}"
        if ctx.time_left() < 8:
            out.append(gc.Result(name, "info", None, note="skipped: section budget"))
            continue
        a = mla_paged_inputs([(past, 1)] * B, H, C, R, BS, bf16, "cuda")
        ms, how = gc.device_time_within(lambda: mla.mla_paged(*a, scale=(C + R) ** -0.5))
        m = {"us": ms * 1e3, "timing": how, "latent_TB/s": B * (past + 1) * (C + R) * 2 / ms / 1e9,
             "TFLOP/s": B * (past + 1) * per_key / ms / 1e9}
        if ctx.copy_tbps:
            m["frac_of_copy"] = m["latent_TB/s"] / ctx.copy_tbps
        out.append(gc.Result(name, "bench", None, m))
    for past in (0, 61440):
        name = f"mla_paged prefill chunk T4096-past{past}"
        if ctx.time_left() < 8:
            out.append(gc.Result(name, "info", None, note="skipped: section budget"))
            continue
        a = mla_paged_inputs([(past, 4096)], H, C, R, BS, bf16, "cuda")
        ms, how = gc.device_time_within(lambda: mla.mla_paged(*a, scale=(C + R) ** -0.5))
        keys = 4096 * past + 4096 * 4097 / 2  # (query, key) pairs under the causal mask
        out.append(gc.Result(name, "bench", None, {"ms": ms, "timing": how, "TFLOP/s": keys * per_key / ms / 1e9}))
    return out
