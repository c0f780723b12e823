"""Run in every rank by tests/runtime/test_rank_serving.py under torchrun: continuous batching on a rank
serving export through the runtime's own path (session.open_serving / serve_prompts, as `k3x run --prompts`),
keeping the logits every token was chosen from; rank 0 saves the records.

    torchrun --nproc-per-node 4 tests/rank_serving_worker.py EXPORT SPEC.json OUT.pt
SPEC: {"prompts": [[ids], ...], "max_new_tokens": [n per prompt], "backend": "pt2", "serve": {ServeOptions fields}}.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from k3x.runtime import session as sessions
from k3x.runtime.serve import ServeOptions
from k3x.text.sampling import SamplingOptions


def main(export: str, spec_file: str, out: str) -> None:
    spec = json.loads(Path(spec_file).read_text())
    s = sessions.open_serving(Path(export), spec["backend"])
    options = ServeOptions(**spec["serve"], keep_logits=True)
    records = sessions.serve_prompts(s, spec["backend"], spec["prompts"], SamplingOptions(), options,
                                     max_new_tokens=spec["max_new_tokens"])
    if s.speaks:
        torch.save([{"index": r.index, "tokens": r.tokens, "logits": r.logits} for r in records], out)
    s.close()


if __name__ == "__main__":
    main(*sys.argv[1:])
