"""bench/prefix_cache.py at a tiny size (k3-mini, 4 requests sharing 64 tokens): its table and JSON, the prefill
tokens the cache saves (exactly: the first request computes its whole prompt in chunks ending at 32 and 64,
snapshotted; the others wait for it, then start from 64 and prefill their 5 own tokens), and tokens equal to
the plain run."""

from __future__ import annotations

import json

from k3x.bench import prefix_cache


def test_tiny_prefix_cache_figures(tmp_path, capsys):
    out = tmp_path / "pc.json"
    r = prefix_cache.main(["--preset", "k3-mini", "--requests", "4", "--prefix", "64", "--suffix", "5", "--new", "2",
                           "--block-size", "8", "--max-step-tokens", "32", "--json", str(out)])
    assert json.loads(out.read_text()) == r
    assert r["prompt_tokens"] == r["prefill_tokens_plain"] == 4 * 69
    assert r["prefill_tokens_cached"] == 69 + 3 * 5 and r["hits"] == 3 and r["tokens_equal"]
    assert r["snapshots_stored"] == 2 and r["snapshots_evicted"] == 0  # at 32 and 64
    assert r["cache_peak_bytes"] >= 2 * r["snapshot_bytes"] > 0
    assert "prefix cache" in capsys.readouterr().out
