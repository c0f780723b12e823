"""Long prompts through `serve()` on the pt2 serving export with k3::mla_paged in small key blocks (16
positions: two pool blocks of 8), so every chunk's attention crosses dozens of key blocks and its own step
blocks: greedy tokens and logits equal each prompt's solo eager run, and every call's temporaries (counted op
by op, model/working.py LiveBytes) stay under `working_bytes` of its rows, whatever the context."""

from __future__ import annotations

import pytest
import torch
from serving_cases import assert_records_match_solo, prompts

from k3x.custom_ops.mla_paged import blocked
from k3x.model import build_model, preset
from k3x.model.working import LiveBytes
from k3x.runtime.serve import ServeOptions, serve, serving_runner
from k3x.text.sampling import SamplingOptions

CFG = preset("k3-mini")
LENGTHS = [900, 3, 250]
NEW = [3, 2, 2]


@pytest.fixture()
def counted(monkeypatch):
    """blocked.mla_paged under a live-bytes count at every call: (rows, longest past, peak bytes) per call."""
    calls = []
    run = blocked.mla_paged

    def mla_paged(*args, **kwargs):
        with LiveBytes(known=[a for a in args if isinstance(a, torch.Tensor)]) as m:
            out = run(*args, **kwargs)
        calls.append((args[0].shape[0], int(args[5].max()), m.peak))
        return out

    monkeypatch.setattr(blocked, "KEY_BLOCK", 16)
    monkeypatch.setattr(blocked, "mla_paged", mla_paged)
    return calls


def test_long_prompts_in_key_blocks_equal_solo(serving_export, counted):
    model = build_model(CFG, dtype=torch.float32, seed=0).eval()
    ps = prompts(LENGTHS, CFG.vocab_size, seed=3)
    opts = ServeOptions(max_sequences=2, block_size=8, max_step_tokens=128, keep_logits=True)
    records = serve(serving_runner("pt2", serving_export), CFG, ps, SamplingOptions(), opts, max_new_tokens=NEW)
    assert_records_match_solo(model, records, ps, NEW, "pt2, key blocks of 16")
    m = CFG.mla
    assert max(past for _, past, _ in counted) >= 768  # chunks late in the long prompt: ~50 key blocks
    over = [(rows, past, peak) for rows, past, peak in counted
            if peak > blocked.working_bytes(rows, m.num_heads, m.kv_lora_rank, m.qk_rope_head_dim, 8)]
    assert not over, f"(rows, past, peak bytes) over working_bytes: {over[:5]}"
