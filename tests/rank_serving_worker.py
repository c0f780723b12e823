"""Run in every rank by tests/runtime/test_rank_serving.py under torchrun: continuous batching on a rank
serving export through the runtime's own path (session.open_serving / serve_prompts, as `k3x run --prompts`),
once per named run (plain, prefix cache, n-gram speculation, both, a draft export), keeping the logits every
token was chosen from; rank 0 saves the records of every run.

    torchrun --nproc-per-node 4 tests/rank_serving_worker.py EXPORT SPEC.json OUT.pt
SPEC: {"prompts": [[ids], ...], "max_new_tokens": [n per prompt], "backend": "pt2",
       "runs": {name: {"serve": {ServeOptions fields}, "speculate": K or null,
                       "draft": {"export": DIR, "tokens": K, "skew": bool} or null,
                       "prompts", "max_new_tokens", "save_state", "load_state": optional}}}.
"prompts" / "max_new_tokens" in a run: its own (else SPEC's); "save_state" / "load_state": a state file of
its first prompt (session.serving_state, as `k3x run --save-state/--load-state`: each rank its own file).
"draft": every rank loads the draft export as `k3x run --draft DIR --speculate-tokens K` does (runtime/serve_prompts.make_drafter,
its ONNX on ort); "skew": the ranks other than 0 alter their drafts after proposing them (`Skewed`: a draft model
whose argmax is not the same on every rank), so only the agreement on rank 0's drafts keeps the ranks' steps alike.
OUT: {name: [{"index", "tokens", "logits", "cached", "drafted", "accepted"} per prompt], "agree": whether every
rank's records (tokens, cached, drafted, accepted) equal rank 0's}.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from k3x.runtime.serve_prompts import Speculation, make_drafter
from k3x.runtime import session as sessions
from k3x.runtime.runners import RunnerOptions
from k3x.runtime.serve import ServeOptions
from k3x.runtime.speculate import NgramDrafter
from k3x.text.sampling import SamplingOptions


class Skewed:
    """A drafter whose drafts on this rank differ from rank 0's: odd ranks drop each sequence's last draft,
    even ones change it (the sizes and the tokens disagree)."""

    def __init__(self, inner, rank: int, vocab_size: int) -> None:
        self.inner, self.rank, self.vocab_size = inner, rank, vocab_size
        self.k = inner.k

    def propose(self, sched) -> None:
        self.inner.propose(sched)
        for seq in (s for s in sched.running.values() if s.draft):
            last = [] if self.rank % 2 else [(seq.draft[-1] + 1) % self.vocab_size]
            seq.draft = [*seq.draft[:-1], *last]


def drafter_of(run: dict, vocab_size: int):
    if run.get("speculate"):
        return NgramDrafter(run["speculate"])
    d = run.get("draft")
    if not d:
        return None
    drafter = make_drafter(Speculation(None, Path(d["export"]), d["tokens"]), "ort", RunnerOptions(), vocab_size)
    return Skewed(drafter, dist.get_rank(), vocab_size) if d.get("skew") and dist.get_rank() else drafter


def main(export: str, spec_file: str, out: str) -> None:
    spec = json.loads(Path(spec_file).read_text())
    s = sessions.open_serving(Path(export), spec["backend"])
    results = {}
    for name, run in spec["runs"].items():
        options = ServeOptions(**run["serve"], keep_logits=True)
        drafter = drafter_of(run, s.cfg.vocab_size)
        prompts, state = run.get("prompts", spec["prompts"]), {}
        if run.get("save_state") or run.get("load_state"):
            files = [Path(run[k]) if run.get(k) else None for k in ("save_state", "load_state")]
            one, state = sessions.serving_state(s, *files, prompts[0])
            prompts = [one]
        records = sessions.serve_prompts(s, spec["backend"], prompts, SamplingOptions(), options, drafter=drafter,
                                         max_new_tokens=run.get("max_new_tokens", spec["max_new_tokens"]), **state)
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
