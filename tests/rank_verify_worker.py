"""Run in every rank by tests/runtime/test_ranks_dist.py under torchrun: `k3x verify EXPORT ARGS` as the CLI
runs it, with one state bug (tests/state_bugs.Corrupts) injected into the program of one rank only.

    torchrun --nproc-per-node 2 tests/rank_verify_worker.py BUG RANK EXPORT [verify options]
"""

from __future__ import annotations

import sys

from state_bugs import Corrupts

from k3x.cli import app
from k3x.runtime import dist_run


def main() -> None:
    bug, bad_rank, *argv = sys.argv[1:]
    honest = dist_run.rank_runner

    def rank_runner(folder, rank: int, options, backend: str = "pt2"):
        runner = honest(folder, rank, options, backend)
        return Corrupts(runner, bug) if rank == int(bad_rank) else runner

    dist_run.rank_runner = rank_runner  # what session._open_ranks builds each rank's program with
    app(["verify", *argv])


if __name__ == "__main__":
    main()
