"""The multi-GPU flags of the CLI (`--tp`, `--ep`, the fit table's `--batch` / `--context`) and
`k3x inspect --tp --ep`. Exporting and running rank programs need no CLI code of their own: the library
reads the plan (export/pipeline.py) or the manifest's `parallel` entry (runtime/session.py).
"""

from __future__ import annotations

from typing import Annotated

import typer

from .cli_support import echo, fail

TP = Annotated[int, typer.Option("--tp", min=1, help="Tensor-parallel ranks (attention heads, FFN, vocab).")]
EP = Annotated[int, typer.Option("--ep", min=1, help="Expert-parallel ranks (routed experts).")]
FitBatch = Annotated[int, typer.Option("--batch", min=1, help="inspect --tp/--ep: sequences for the fit table.")]
FitContext = Annotated[int, typer.Option("--context", min=1, help="inspect --tp/--ep: tokens per sequence.")]


def inspect_parallel(cfg, tp: int, ep: int, batch: int, context: int, json_out: bool) -> None:
    import json

    from .model.config import ConfigError
    from .model.parallel import ParallelPlan
    from .model.parallel_budget import budget, format_budget

    try:
        b = budget(cfg, ParallelPlan(tp, ep), batch=batch, context=context)
    except ConfigError as e:
        fail(str(e))
    echo(json.dumps(b) if json_out else format_budget(b))
