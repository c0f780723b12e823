"""The runner session the `run` and `verify` commands open over an export of any rank count: the runner
options from the command's flags, rank programs spawned when no launcher started them (this command is run in
tp x ep processes, then this one exits), the export's notes printed by the speaking rank, and the state-file
flags checked before a runner loads."""

from __future__ import annotations

import sys
from pathlib import Path

import typer

from ..console import Printer, debug, echo, fail, one_line, timed
from . import session as sessions
from .runners import RunnerError, RunnerOptions
from .state_file import Shard, shard_path, state_hooks, weights_origin


def runner_options(provider: str, skip_hash_check: bool, checkpoint: Path | None = None,
                   cuda_graph: bool = False) -> RunnerOptions:
    """The runners' options from the command's flags (`provider`: --provider's value)."""
    if skip_hash_check:
        echo("note: sha256 check of the artifact files skipped (--skip-hash-check); AOTI packages are still checked",
             err=True)
    return RunnerOptions(provider=provider, checkpoint=checkpoint, check_hashes=not skip_hash_check,
                         device="cuda" if cuda_graph else "cpu", cuda_graph=cuda_graph)


def ranks_here(export_dir: Path, backends: list[str], *, default_ort: bool = False) -> tuple[list[str], list[str]]:
    """(backends, notes) of an export of any rank count (refused before spawning); rank programs outside a
    launcher: this command is run in tp x ep processes, then this one exits."""
    names, notes = sessions.backends_of(export_dir, backends, default_ort=default_ort)
    world = sessions.world_to_spawn(export_dir)
    if world:
        debug("spawning %d rank processes", world)
        sessions.spawn_world(world, sys.argv[1:])
        raise typer.Exit(code=0)
    return names, notes


def open_session(export_dir: Path, backends: list[str], options, *, default_ort: bool = False):
    """The runners of `backends` (default: every one the export has) over an export of any rank count."""
    names, notes = ranks_here(export_dir, backends, default_ort=default_ort)
    with timed(f"open {export_dir} ({', '.join(names)})"):
        s = sessions.open_session(export_dir, names, options)
    for line in notes if s.speaks else ():
        echo(line, err=line.startswith("note:"))
    return s


def close_session(s) -> None:
    line = sessions.peak_rss_line(s)
    if line and s.speaks:
        echo(line)
    s.close()


def check_state_flags(export_dir: Path, folder, prompts: Path | None, load: Path | None, prompt_given, cached
                      ) -> None:
    """--save-state / --load-state: one sequence of one program (batch interface or serving step), or of rank
    programs of a serving step (one file per rank: every rank's file of --load-state must be there)."""
    if prompts is not None:
        fail("--save-state / --load-state: one sequence (--prompt / --prompt-ids), not --prompts")
    world = sessions.parallel_plan(folder).world
    if world > 1 and "serving" not in folder.manifest:
        fail(f"--save-state / --load-state: {export_dir} holds rank programs of the batch interface; use a serving "
             "export (export --serving) or a one-program export")
    missing = [f for r in range(world) if load is not None and not (f := shard_path(load, Shard(r, world))).exists()]
    if missing:
        fail(f"--load-state {missing[0]}: does not exist"
             + (f" (this export runs {world} ranks, each reads its own file)" if world > 1 else ""))
    if prompt_given:
        fail("give --load-state or a prompt, not both: the state file holds its sequence")
    if cached:
        fail("--prefix-cache with --load-state: a resumed sequence starts from its own state")


def decode_export(export_dir: Path, folder, backend: str, prepared, options: RunnerOptions, *,
                  save_state: Path | None, load_state: Path | None) -> None:
    """`k3x run` on a batch-interface export: one sequence (or its state file) decoded with `backend`, the text
    streamed and the ids and timing printed by the speaking rank."""
    import torch

    try:  # a state file is checked before any runner loads
        ids, state = state_hooks(save_state, load_state, folder.state_contract(), folder.config(), prepared.ids,
                                 origin=weights_origin(folder.manifest))
    except RunnerError as e:
        fail(str(e))
    s = open_session(export_dir, [backend], options, default_ort=True)
    (name,) = s.runners
    new_tokens = prepared.options.max_new_tokens
    try:
        sessions.check(s, batch=1, prompt_len=len(ids), new_tokens=new_tokens, backends=[name])
        runner = s.runners[name]
        if s.speaks:
            echo(f"backend {name}" + (f" on {runner.provider}" if hasattr(runner, "provider") else ""))
        printer = Printer(prepared.tokenizer if s.speaks else None, prepared.options.eos_token_ids)
        g = sessions.decode(s, name, torch.tensor([ids]), prepared.options, on_token=printer, **state)
    except RunnerError as e:
        fail(f"{s.who}{e}")
    except Exception as e:  # noqa: BLE001 - one line (per rank), no traceback
        fail(f"{s.who}backend {name}: {one_line(e)}")
    if s.speaks:
        printer.finish(g, len(ids), s.describe(name) + (f", state from {load_state}" if load_state else ""))
    close_session(s)
