"""model/working.py: a serving step's working memory from a meta-device run (`k3x inspect --chunk`). The
figure equals the same count over a real CPU step of the k3-mini model at a short and at a long past (the
step holds nothing that grows with the context), grows with the chunk, and the CLI prints it with the peak.
A real step whose custom ops' temporaries are measured (their CPU implementations run under a live-bytes
count of their own) stays under the figure, within 60 % at a 64-row chunk (measured 1.51: k3::kda_packed's
bound holds four [H, C, C, K] per chunk, its einsum's worst case, where the step's layouts take three; its
per-chunk decays are the peak of such a chunk: the count without the ops' internals is under a quarter)."""

from __future__ import annotations

import torch
from typer.testing import CliRunner

from k3x.bench.serving_steps import StepCase
from k3x.cli import app
from k3x.model import build_model, preset
from k3x.model.serving import K3ServingStep
from k3x.model.state import pool_bytes
from k3x.model.summary import scaled_bytes
from k3x.custom_ops.attn_res import reference as attn_res_ref
from k3x.custom_ops.kda_packed import reference as kda_packed_ref
from k3x.custom_ops.mla_paged import blocked
from k3x.custom_ops.moe import reference as moe_ref
from k3x.model.working import LiveBytes, inner_bytes, step_working_bytes

CFG = preset("k3-mini")


IMPLEMENTATIONS = {  # op -> its CPU implementation on the op's args
    "kda_packed": lambda a: kda_packed_ref.kda_packed(*a[:8], scale=a[8]),
    "attn_res": lambda a: attn_res_ref.attn_res(*a[:5]),
    "moe": lambda a: moe_ref.moe(*a[:13], expert_offset=a[14] if len(a) > 14 else None),
    "mla_paged": lambda a: blocked.mla_paged(*a[:8]),
}


def measured(name: str):
    """fn(args) -> the live-bytes peak of op `name`'s CPU implementation on them (its outputs included)."""
    def peak(args) -> int:
        with LiveBytes([a for a in args if isinstance(a, torch.Tensor)]) as m:
            IMPLEMENTATIONS[name](args)
        return m.peak
    return peak


def real_step_peak(step, rows: int, past: int, inner: dict) -> int:
    case = StepCase(CFG, batch=1, positions=past + rows, capacity=past + rows, block_size=16)
    feeds = case.feeds(rows, past)
    pools = [feeds.pop(k) for k in list(feeds) if k.startswith("pool.")]
    known = [*feeds.values(), *pools, *step.parameters(), *step.buffers()]
    with torch.no_grad(), LiveBytes(known, inner) as m:
        step(**feeds, pools=pools)
    return m.peak


def test_meta_figure_equals_a_real_step_at_any_past():
    step = K3ServingStep(build_model(CFG, dtype=torch.float32, seed=0), kernels="reference")
    w = step_working_bytes(CFG, 64, 16)
    inner = inner_bytes()
    assert real_step_peak(step, 64, 600, inner) == real_step_peak(step, 64, 3000, inner) == w["total_bytes"]
    assert 0 < w["attention_bytes"] < w["total_bytes"] < step_working_bytes(CFG, 256, 16)["total_bytes"]
    assert w["kda_bytes"] < w["total_bytes"]


def test_real_temporaries_stay_under_the_figure():
    step = K3ServingStep(build_model(CFG, dtype=torch.float32, seed=0), kernels="reference")
    w = step_working_bytes(CFG, 64, 16)["total_bytes"]
    real = real_step_peak(step, 64, 600, {getattr(torch.ops.k3, n).default: measured(n) for n in IMPLEMENTATIONS})
    outputs_only = real_step_peak(step, 64, 600, {})
    assert real <= w <= 1.6 * real, (real, w)
    assert outputs_only < w / 4, (outputs_only, w)


def test_inspect_prints_the_step_working_memory_and_peak():
    r = CliRunner().invoke(app, ["inspect", "--preset", "k3-mini", "--context", "4096", "--sequences", "1",
                                 "--dtype", "fp32", "--chunk", "64"])
    assert r.exit_code == 0, r.output
    w = step_working_bytes(CFG, 64, 16)["total_bytes"]
    pools = pool_bytes(CFG, 4096, 1, 16, dtype=torch.float32)["total_bytes"]
    assert f"step working memory (64 tokens, MLA key blocks of 512): {scaled_bytes(w)}" in r.output
    assert f"peak (pools + step): {scaled_bytes(pools + w)}" in r.output
