"""model/working.py: a serving step's working memory from a meta-device run (`k3x inspect --chunk`). The
figure equals the same count over a real CPU step of the k3-mini model at a short and at a long past (the
step holds nothing that grows with the context), grows with the chunk, and the CLI prints it with the peak."""

from __future__ import annotations

import torch
from typer.testing import CliRunner

from k3x.bench.serving_steps import StepCase
from k3x.cli import app
from k3x.model import build_model, preset
from k3x.model.serving import K3ServingStep
from k3x.model.state import pool_bytes
from k3x.model.working import LiveBytes, attention_bytes, step_working_bytes

CFG = preset("k3-mini")


def real_step_peak(step, rows: int, past: int) -> int:
    case = StepCase(CFG, batch=1, positions=past + rows, capacity=past + rows, block_size=16)
    feeds = case.feeds(rows, past)
    pools = [feeds.pop(k) for k in list(feeds) if k.startswith("pool.")]
    known = [*feeds.values(), *pools, *step.parameters(), *step.buffers()]
    with torch.no_grad(), LiveBytes(known, {torch.ops.k3.mla_paged.default: attention_bytes}) as m:
        step(**feeds, pools=pools)
    return m.peak


def test_meta_figure_equals_a_real_step_at_any_past():
    step = K3ServingStep(build_model(CFG, dtype=torch.float32, seed=0), kernels="reference")
    w = step_working_bytes(CFG, 64, 16)
    assert real_step_peak(step, 64, 600) == real_step_peak(step, 64, 3000) == w["total_bytes"]
    assert 0 < w["attention_bytes"] < w["total_bytes"] < step_working_bytes(CFG, 256, 16)["total_bytes"]


def test_inspect_prints_the_step_working_memory_and_peak():
    r = CliRunner().invoke(app, ["inspect", "--preset", "k3-mini", "--context", "4096", "--sequences", "1",
                                 "--dtype", "fp32", "--chunk", "64"])
    assert r.exit_code == 0, r.output
    w = step_working_bytes(CFG, 64, 16)["total_bytes"]
    pools = pool_bytes(CFG, 4096, 1, 16, dtype=torch.float32)["total_bytes"]
    assert f"step working memory (64 tokens, MLA key blocks of 512): {w / 2 ** 20:,.1f} MiB" in r.output
    assert f"peak (pools + step): {(pools + w) / 2 ** 20:,.1f} MiB" in r.output
