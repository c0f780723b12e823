"""The `k3x` command line (console script `k3x = "k3x.cli:app"`, and `python -m k3x`).

app.py holds the Typer app (its one error mapping, `-v`, `--version`); options.py every flag type;
console.py what commands print. One module per command group registers its commands on `app`:
checkpoint.py (init-checkpoint, inspect), export.py (export, build-engine), run.py (generate, run, logits),
verify.py (verify). A new group (e.g. serving) is one module here plus one name in the import below.
Commands parse, call the library and print; torch and the library load inside the command bodies, after
the arguments are checked, so `--help` and bad arguments answer at once.
"""

from __future__ import annotations

from . import checkpoint, export, run, verify  # noqa: F401 - each registers its commands on `app`
from .app import app

__all__ = ["app"]
