"""`python -m k3x ...` = the `k3x` command (what torchrun / torch.distributed.run start in every rank)."""

from __future__ import annotations

from .cli import app

if __name__ == "__main__":
    app()
