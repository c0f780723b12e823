"""`python -m k3x ...` = the `k3x` command (what torchrun / torch.distributed.run start in every rank)."""

from __future__ import annotations

import os

if __name__ == "__main__":
    if os.environ.get("K3X_SPAWNED_BY"):  # dist_run.SPAWNED_BY: a rank `k3x run` / `k3x serve` started ends with it
        from .runtime.dist_run import follow_spawner

        follow_spawner()
    from .cli import app

    app()
