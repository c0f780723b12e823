"""Runner flags of the k3x CLI shared by `run`, `verify`, `logits` and `generate`, plus `export --max-context`;
the session `run` and `verify` open over an export of any rank count (runtime/session.py).

Notable choices:
- `--cuda-graph` runs the torch runners (eager, pt2) on CUDA and replays repeated-shape decode steps as CUDA
  graphs (runtime/cuda_graph.py); the aoti runner needs a package compiled for CUDA and trt captures its
  engine. Where no graph can be captured (no CUDA device, ONNX Runtime, an AOTI package compiled for CPU) the
  command is refused in one line, never silently run without graphs.
- Graphs replay only when a decode step's shapes repeat: hybrid models need the static latent cache
  (`export --max-context N`). `generate --cuda-graph` gives the checkpoint's model a static cache sized to
  the request (prompt + new tokens), so every decode step has one shape.
- `verify`'s eager reference always runs plainly on the CPU (`reference_options`).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Annotated, Optional

import typer

from .cli_support import fail

SKIP_HASH_HELP = "Do not sha256 the artifact files before loading (huge files; paths and sizes are still checked)."
SkipHashCheck = Annotated[bool, typer.Option("--skip-hash-check", help=SKIP_HASH_HELP)]
CudaGraph = Annotated[bool, typer.Option(
    "--cuda-graph", help="CUDA only: run on the GPU and replay decode steps as CUDA graphs (torch runners, aoti "
                         "packages compiled for CUDA, trt). Hybrid models replay only with a static latent "
                         "cache (export --max-context).")]
MaxContext = Annotated[Optional[int], typer.Option(
    min=1, help="Static MLA latent cache: preallocate this many positions (one shape per decode step, so decode "
                "can be a CUDA graph); longer requests are refused. Default: a cache that grows each step.")]


def runner_options(provider: str, skip_hash_check: bool, checkpoint: Path | None = None, cuda_graph: bool = False):
    from .runtime.runners import RunnerOptions

    if skip_hash_check:
        typer.echo("note: sha256 check of the artifact files skipped (--skip-hash-check); AOTI packages are "
                   "still checked", err=True)
    return RunnerOptions(provider=provider, checkpoint=checkpoint, check_hashes=not skip_hash_check,
                         device="cuda" if cuda_graph else "cpu", cuda_graph=cuda_graph)


def reference_options(options):
    """The eager reference of `verify`: the same files and checks, on the CPU, without graphs."""
    return dataclasses.replace(options, device="cpu", cuda_graph=False)


def eager_generate(model, prompt, options, on_token, cuda_graph: bool):
    """`k3x generate`: the eager model on the CPU, or with `cuda_graph` on CUDA through a graphed runner with a
    static latent cache of prompt + new tokens positions. RunnerError (one line) where CUDA is missing."""
    from .runtime.generate import generate as plain_generate
    from .runtime.runners import ModuleRunner, generate

    if not cuda_graph:
        return plain_generate(model, prompt, options, on_token=on_token)
    from .runtime.cuda_graph import require_cuda_graph

    from .model.options import CacheOptions

    cfg = model.cfg
    cache = CacheOptions(min(prompt.shape[1] + options.max_new_tokens, cfg.max_position_embeddings))
    runner = require_cuda_graph(ModuleRunner("eager", model, cfg, "cuda", cache), "generate")  # refused without CUDA
    model.to("cuda")
    return generate(runner, cfg, prompt, options, dtype=model.model.embed_tokens.weight.dtype, on_token=on_token,
                    cache=cache)


def open_session(export_dir: Path, backends: list[str], options, *, default_ort: bool = False):
    """The runners of `backends` (default: every one the export has) over an export of any rank count; rank
    programs outside a launcher: the same command is run in tp x ep processes here, then this one exits."""
    import sys

    from .runtime import session as sessions
    from .runtime.runners import RunnerError

    try:
        names, notes = sessions.backends_of(export_dir, backends, default_ort=default_ort)  # refused before spawning
        world = sessions.world_to_spawn(export_dir)
        if world:
            sessions.spawn_world(world, sys.argv[1:])
            raise typer.Exit(code=0)
        s = sessions.open_session(export_dir, names, options)
    except RunnerError as e:
        fail(str(e))
    for line in notes if s.speaks else ():
        typer.echo(line, err=line.startswith("note:"))
    return s


def close_session(s) -> None:
    from .runtime import session as sessions

    line = sessions.peak_rss_line(s)
    if line and s.speaks:
        typer.echo(line)
    s.close()
