"""The multi-GPU side of the CLI: `k3x export --tp T --ep E`, `k3x run` / `k3x verify` on a sharded export
(under torchrun, or spawning the ranks through torch.distributed.run), `k3x inspect --tp --ep`.

A sharded export is recognised by the `parallel` entry of its top-level manifest (exporter/ranks.py).
Inside a launcher every rank runs the same command; rank 0 prints. Peak RSS is reported per rank.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from .cli_support import fail, one_line

TP = Annotated[int, typer.Option("--tp", min=1, help="Tensor-parallel ranks (attention heads, FFN, vocab).")]
EP = Annotated[int, typer.Option("--ep", min=1, help="Expert-parallel ranks (routed experts).")]
FitBatch = Annotated[int, typer.Option("--batch", min=1, help="inspect --tp/--ep: sequences for the fit table.")]
FitContext = Annotated[int, typer.Option("--context", min=1, help="inspect --tp/--ep: tokens per sequence.")]


def _sharded(export_dir: Path):
    """(top-level manifest, plan) of a sharded export; None for anything else (the single-program path
    names the problem); a bad `parallel` entry is one line naming it."""
    from .exporter.artifacts import ManifestError, read_manifest
    from .exporter.ranks import read_parallel

    try:
        if "parallel" not in read_manifest(export_dir):
            return None
    except ManifestError:
        return None
    try:
        return read_parallel(export_dir)
    except ManifestError as e:
        fail(str(e))


def _backends(export_dir: Path, data, requested: list[str], default_ort: bool = False) -> list[str]:
    """The rank runners to use: `requested` (each must be in the export), or every one the export has.
    `k3x run`'s default `--backend ort` on a pt2-only sharded export runs pt2 (and says so)."""
    from .exporter.dist_run import rank_backends

    have = rank_backends(export_dir, data)
    if default_ort and requested == ["ort"] and "ort" not in have and "pt2" in have:
        if os.environ.get("RANK", "0") == "0":  # the launching process and rank 0 say it
            typer.echo("backend ort: this sharded export has no ONNX; running the pt2 rank programs")
        return ["pt2"]
    missing = [b for b in requested if b not in have]
    if missing:
        fail(f"{export_dir}: sharded export has rank programs for {have}, not {missing}")
    return requested or have


def _start(export_dir: Path, data, plan, skip_hash_check: bool, backends: list[str]):
    """In a launcher: (rank, TP group, {backend: this rank's runner}); outside one: spawn the ranks and exit."""
    from .exporter import dist_run
    from .exporter.runners import RunnerError, RunnerOptions

    if len(data["parallel"]["ranks"]) != plan.world:
        fail(f"{export_dir}: weightless rank export (exported with --no-weights); it cannot run")
    if not dist_run.launched():
        try:
            dist_run.spawn(plan.world, sys.argv[1:])
        except RunnerError as e:
            fail(str(e))
        raise typer.Exit(code=0)
    try:
        rank, tp_pg = dist_run.init(plan)
        options = RunnerOptions(check_hashes=not skip_hash_check)
        return rank, tp_pg, {b: dist_run.rank_runner(export_dir, data, rank, options, b) for b in backends}
    except RunnerError as e:
        fail(str(e))


def _report_rss(rank: int) -> None:
    import torch.distributed as dist

    from .exporter.dist_run import peak_rss_mib

    rss: list = [None] * dist.get_world_size()
    dist.all_gather_object(rss, round(peak_rss_mib(), 1))
    if rank == 0:
        typer.echo("peak RSS per rank (MiB): " + ", ".join(f"{r}: {m}" for r, m in enumerate(rss)))


def run_sharded(export_dir: Path, prompt, prompt_ids, chat: bool, sampling, skip_hash_check: bool,
                backend: str = "pt2") -> bool:
    """`k3x run` on a sharded export (False: not sharded, the caller runs the single program)."""
    import torch

    from .cli_decode import Printer, prepare
    from .exporter import dist_run
    from .exporter.artifacts import DTYPES
    from .exporter.runners import RunnerError, check_request, generate

    found = _sharded(export_dir)
    if found is None:
        return False
    data, plan = found
    (backend,) = _backends(export_dir, data, [backend], default_ort=True)
    rank, _, runners = _start(export_dir, data, plan, skip_hash_check, [backend])
    runner = runners[backend]
    from .model.config import K3Config

    cfg = K3Config.from_dict(data["config"])
    p = prepare(export_dir, cfg.vocab_size, prompt, prompt_ids, chat, sampling)
    local = dist_run._folder_cfg(export_dir, data, rank)
    printer = Printer(p.tokenizer if rank == 0 else None)
    try:
        check_request(cfg, batch=1, prompt_len=len(p.ids), new_tokens=sampling.max_new_tokens, backend=backend,
                      dims=data["dynamic_dims"])
        g = generate(runner, local, torch.tensor([p.ids]), p.options, on_token=printer, dtype=DTYPES[data["dtype"]])
    except RunnerError as e:
        fail(f"rank {rank}: {e}")
    except Exception as e:  # noqa: BLE001 - one line per rank, no traceback
        fail(f"rank {rank}: {one_line(e)}")
    if rank == 0:
        printer.finish(g, len(p.ids), f"{plan.world} ranks, tp={plan.tp} ep={plan.ep}, {backend}")
    _report_rss(rank)
    dist_run.shutdown()
    return True


def verify_sharded(export_dir: Path, steps: int, prompt_len: int, batch: int, seed: int,
                   checkpoint: Optional[Path], json_out: Optional[Path], skip_hash_check: bool,
                   backends: str = "") -> bool:
    """`k3x verify` on a sharded export: every rank runs the parity harness with the rank programs behind
    the single-GPU interface (states gathered and merged) against the eager model, plus greedy tokens."""
    import json

    import torch

    from .exporter import dist_run
    from .exporter.artifacts import DTYPES
    from .exporter.runners import RunnerOptions, check_request, generate, make_runner
    from .exporter.verify import run_parity
    from .model.config import K3Config
    from .model.sampling import SamplingOptions

    found = _sharded(export_dir)
    if found is None:
        return False
    data, plan = found
    names = _backends(export_dir, data, [b.strip() for b in backends.split(",") if b.strip()])
    rank, tp_pg, runners = _start(export_dir, data, plan, skip_hash_check, names)
    cfg = K3Config.from_dict(data["config"])
    local = dist_run._folder_cfg(export_dir, data, rank)
    dtype = DTYPES[data["dtype"]]
    try:
        for b in names:
            check_request(cfg, batch=batch, prompt_len=prompt_len, new_tokens=steps + 1, backend=b,
                          dims=data["dynamic_dims"])
        reference = make_runner("eager", export_dir, RunnerOptions(checkpoint=checkpoint))
        wholes = [dist_run.WholeStateRunner(runners[b], cfg, local, plan, rank, tp_pg, b) for b in names]
        report = run_parity(reference, wholes, cfg, steps=steps, batch=batch, prompt_len=prompt_len, dtype=dtype,
                            seed=seed)
        prompt = torch.randint(0, cfg.vocab_size, (1, prompt_len), generator=torch.Generator().manual_seed(seed))
        greedy = SamplingOptions(steps + 1)
        want = generate(reference, cfg, prompt, greedy, dtype=dtype).tokens
        gots = [generate(w, cfg, prompt, greedy, dtype=dtype).tokens for w in wholes]
    except Exception as e:  # noqa: BLE001 - one line per rank, no traceback
        fail(f"verify rank {rank}: {one_line(e)}")
    same = all(torch.equal(want, got) for got in gots)
    got = next((g for g in gots if not torch.equal(want, g)), want)
    if rank == 0:
        typer.echo(report.table())
        typer.echo(f"greedy tokens ({steps + 1}): " + ("identical" if same else f"DIFFER {got.tolist()} != "
                                                                                 f"{want.tolist()}"))
        if json_out:
            json_out.write_text(json.dumps({**report.to_json(), "greedy_identical": same,
                                            "tokens": want.tolist(), "plan": plan.to_dict(),
                                            "backends": names}, indent=2) + "\n")
    _report_rss(rank)
    dist_run.shutdown()
    if not (report.ok and same):
        raise typer.Exit(code=1)
    return True


def inspect_parallel(cfg, tp: int, ep: int, batch: int, context: int, json_out: bool) -> None:
    import json

    from .model.config import ConfigError
    from .model.parallel import ParallelPlan
    from .model.parallel_budget import budget, format_budget

    try:
        b = budget(cfg, ParallelPlan(tp, ep), batch=batch, context=context)
    except ConfigError as e:
        fail(str(e))
    typer.echo(json.dumps(b) if json_out else format_budget(b))
