"""Restarting bench/gpu_check.py in a fresh process when a section leaves the device unusable: a CUDA fault
(an illegal address, say) poisons the process's context for good, so every later section would fail on it. The
run stops with `DeviceLost`, the report on disk holds everything so far, and `main` re-executes the script with
`continuation`'s arguments: the remaining sections, what is left of the budget, and the report to carry on
from. torch only (imported inside)."""

from __future__ import annotations

import sys
from pathlib import Path


class DeviceLost(Exception):
    """`section` left the device unusable (a CUDA fault poisons the process's context for good): the sections
    named in `remaining` must run in a fresh process, after `results` (everything so far)."""

    def __init__(self, section: str, remaining: list[str], results: list) -> None:
        super().__init__(f"the device is unusable after {section}")
        self.section, self.remaining, self.results = section, remaining, results


def device_alive(ctx) -> bool:
    """Whether the device still runs work (after a section raised): a sync and a small allocation."""
    if ctx.device != "cuda":
        return True
    import torch

    try:
        torch.cuda.synchronize()
        torch.ones(1, device="cuda").add_(1).item()
        return True
    except Exception:  # noqa: BLE001 - any failure here means the context is gone
        return False


def continuation(argv: list[str] | None, remaining: list[str], budget_left: float, path: Path) -> list[str]:
    """The arguments of the fresh process that runs `remaining` within what is left of the budget, after the
    results in `path`: this run's own flags, less --only / --budget / --continue-from."""
    given = list(sys.argv[1:] if argv is None else argv)
    kept, skip = [], False
    for a in given:
        if skip:
            skip = False
        elif a in ("--only", "--budget", "--continue-from"):
            skip = True
        elif not a.startswith(("--only=", "--budget=", "--continue-from=")):
            kept.append(a)
    return [*kept, "--only", ",".join(remaining), "--budget", f"{max(budget_left, 0.0):.1f}",
            "--continue-from", str(path)]
