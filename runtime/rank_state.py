"""State checks of `k3x verify` on rank programs: every rank's own program is handed its share of
the reference's TRUE state at every step and judged by runtime/state_check.check_state against the rank
folder's state contract (its shapes: the KDA heads split by TP, the latent whole), so a zeroed, stale or
transposed state on any one rank is reported, naming the rank and the layers.

- The rank's steps: the whole-model reference's steps with every state input and output cut to the rank's
  share (dist_run.WholeStateRunner.share); the logits are whole on every rank.
- A candidate wrong input (the rank's KDA share zeroed, one step stale, transposed) is rerun on the reference
  with the other ranks' shares true (`with_share`), so only the rank whose program decoded from it matches.
- Every rank's findings go to every rank (one verdict, one exit code), as `BACKEND rank R`. In a step where a
  rank's logits are explained by a wrong input of its own, the other ranks' unexplained differences there (the
  shared logits, their KDA states of the layers after it, fed by its output) are its consequences, left out.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist

from .base import Feeds, Runner
from .dist_run import WholeStateRunner
from .state_check import StateFinding, check_state

CAUSE = "decoded from"  # a logits finding that names the wrong input the runner decoded from
CONSEQUENCES = ("differ from the reference's continuation", "differs from the reference's state")


def rank_state_findings(reference: Runner, runners: dict[str, WholeStateRunner], contract: dict[str, Any],
                        run: list[tuple[Feeds, Feeds]], *, rank: int, prompt: torch.Tensor,
                        dtype: torch.dtype) -> list[StateFinding]:
    """The findings of every rank's program of every backend (a collective: every rank calls it alike);
    `run`: the reference's whole-state steps (state_check.reference_steps), `contract`: this rank's."""
    mine: list[StateFinding] = []
    for backend, whole in runners.items():
        share = [(whole.share(feeds), whole.share(out, "output_name")) for feeds, out in run]

        def rerun(step: int, wrong: Feeds, whole: WholeStateRunner = whole) -> Feeds:
            return reference.infer(whole.with_share(run[step][0], wrong))

        found = check_state(reference, whole.runner, whole.cfg, contract, prompt=prompt, dtype=dtype, run=share,
                            rerun=rerun)
        mine += [replace(f, backend=f"{backend} rank {rank}") for f in found]
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return causes([f for found in every for f in found])


def causes(findings: list[StateFinding]) -> list[StateFinding]:
    """`findings` less the consequences, on other ranks, of a wrong input one rank's logits are explained by."""
    explained = {(_backend(f), f.step, f.backend) for f in findings
                 if f.what == "logits" and f.problem.startswith(CAUSE)}

    def consequence(f: StateFinding) -> bool:
        return f.problem.startswith(CONSEQUENCES) and any(
            (b, step) == (_backend(f), f.step) and who != f.backend for b, step, who in explained)

    return [f for f in findings if not consequence(f)]


def _backend(f: StateFinding) -> str:
    return f.backend.rsplit(" rank ", 1)[0]
