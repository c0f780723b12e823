"""A serialised ONNX model's outputs over a prefill and one decode step on ONNX Runtime's CPU provider, for the
tests that compare a rewritten graph with the graph before it (tests/exporter/test_onnx_rewrites_*.py)."""

from __future__ import annotations

import numpy as np
import torch


def prefill_and_decode(data: bytes, cfg, cache=None, library=None) -> list[np.ndarray]:
    """Every output of a prefill of 2 x 5 tokens and of one decode step after it (`library`: the kernel library
    registered, else the function bodies)."""
    import onnxruntime as ort

    from k3x.runtime.runners import next_feeds, start_feeds

    so = ort.SessionOptions()
    if library is not None:
        so.register_custom_ops_library(str(library))
    sess = ort.InferenceSession(data, so, providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]

    def run(feeds) -> dict:
        return dict(zip(names, sess.run(None, {k: v.numpy() for k, v in feeds.items()})))

    ids = torch.randint(0, cfg.vocab_size, (2, 5), generator=torch.Generator().manual_seed(3))
    first = run(start_feeds(cfg, ids, cache=cache))
    second = run(next_feeds(cfg, {k: torch.from_numpy(v) for k, v in first.items()}, ids[:, -1:], cache=cache))
    return [first[n] for n in names] + [second[n] for n in names]
