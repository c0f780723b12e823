"""Run in every rank by tests/runtime/test_rank_serving.py under torchrun: continuous batching on a rank
serving export through the runtime's own path (session.open_serving / serve_prompts, as `k3x run --prompts`),
once per named run (plain, prefix cache, n-gram speculation, both), keeping the logits every token was chosen
from; rank 0 saves the records of every run.

    torchrun --nproc-per-node 4 tests/rank_serving_worker.py EXPORT SPEC.json OUT.pt
SPEC: {"prompts": [[ids], ...], "max_new_tokens": [n per prompt], "backend": "pt2",
       "runs": {name: {"serve": {ServeOptions fields}, "speculate": K or null}}}.
OUT: {name: [{"index", "tokens", "logits", "cached", "drafted", "accepted"} per prompt], "agree": whether every
rank's records (tokens, cached, drafted, accepted) equal rank 0's}.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from k3x.runtime import session as sessions
from k3x.runtime.serve import ServeOptions
from k3x.runtime.speculate import NgramDrafter
from k3x.text.sampling import SamplingOptions


def main(export: str, spec_file: str, out: str) -> None:
    spec = json.loads(Path(spec_file).read_text())
    s = sessions.open_serving(Path(export), spec["backend"])
    results = {}
    for name, run in spec["runs"].items():
        options = ServeOptions(**run["serve"], keep_logits=True)
        drafter = NgramDrafter(run["speculate"]) if run.get("speculate") else None
        records = sessions.serve_prompts(s, spec["backend"], spec["prompts"], SamplingOptions(), options,
                                         max_new_tokens=spec["max_new_tokens"], drafter=drafter)
        results[name] = [{"index": r.index, "tokens": r.tokens, "logits": r.logits, "cached": r.cached,
                          "drafted": r.counts.drafted, "accepted": r.counts.accepted} for r in records]
    mine = {n: [(r["tokens"], r["cached"], r["drafted"], r["accepted"]) for r in rs] for n, rs in results.items()}
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    if s.speaks:
        torch.save({**results, "agree": all(e == mine for e in every)}, out)
    s.close()


if __name__ == "__main__":
    main(*sys.argv[1:])
