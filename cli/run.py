"""Commands that decode or score: `generate` (a checkpoint's eager model), `run` (an exported artifact, any
rank count) and `logits` (full-sequence logits for parity checks by anyone); plus the runner session `run`
and `verify` share (rank programs outside a launcher: the same command is run in tp x ep processes).

Serving commands (many prompts, batching) belong in their own group module next to this one (cli/serve.py),
with their flag types in options.py.
"""

from __future__ import annotations

import sys
from pathlib import Path

import typer

from .app import app
from .console import Printer, debug, echo, fail, one_line, timed
from .options import Backend, BatchFile, CacheBlocks, Chat, Checkpoint, CheckpointRequired, CudaGraph, Draft, \
    ExportDir, InputIds, JsonOut, LogitsBackend, LogitsExportDir, LogitsOut, LoadState, MaxNewTokens, MaxSequences, \
    MaxStepTokens, OrtProvider, PrefixCache, PrefixCacheMB, PromptIds, PromptsFile, PromptText, Provider, RunBackend, \
    SamplerSeed, SaveState, SkipHashCheck, Speculate, SpeculateTokens, Temperature, TopK, TopP


def runner_options(provider: Provider, skip_hash_check: bool, checkpoint: Path | None = None,
                   cuda_graph: bool = False):
    from ..runtime.runners import RunnerOptions

    if skip_hash_check:
        echo("note: sha256 check of the artifact files skipped (--skip-hash-check); AOTI packages are still checked",
             err=True)
    return RunnerOptions(provider=provider.value, checkpoint=checkpoint, check_hashes=not skip_hash_check,
                         device="cuda" if cuda_graph else "cpu", cuda_graph=cuda_graph)


def ranks_here(export_dir: Path, backends: list[str], *, default_ort: bool = False) -> tuple[list[str], list[str]]:
    """(backends, notes) of an export of any rank count (refused before spawning); rank programs outside a
    launcher: this command is run in tp x ep processes, then this one exits."""
    from ..runtime import session as sessions

    names, notes = sessions.backends_of(export_dir, backends, default_ort=default_ort)
    world = sessions.world_to_spawn(export_dir)
    if world:
        debug("spawning %d rank processes", world)
        sessions.spawn_world(world, sys.argv[1:])
        raise typer.Exit(code=0)
    return names, notes


def open_session(export_dir: Path, backends: list[str], options, *, default_ort: bool = False):
    """The runners of `backends` (default: every one the export has) over an export of any rank count."""
    from ..runtime import session as sessions

    names, notes = ranks_here(export_dir, backends, default_ort=default_ort)
    with timed(f"open {export_dir} ({', '.join(names)})"):
        s = sessions.open_session(export_dir, names, options)
    for line in notes if s.speaks else ():
        echo(line, err=line.startswith("note:"))
    return s


def close_session(s) -> None:
    from ..runtime import session as sessions

    line = sessions.peak_rss_line(s)
    if line and s.speaks:
        echo(line)
    s.close()


@app.command()
def generate(checkpoint: CheckpointRequired, prompt: PromptText = None, prompt_ids: PromptIds = None,
             chat: Chat = False, max_new_tokens: MaxNewTokens = 16, temperature: Temperature = 0.0, top_k: TopK = 0,
             top_p: TopP = 1.0, seed: SamplerSeed = None, cuda_graph: CudaGraph = False) -> None:
    """Decode with the eager PyTorch model (prefill, then decode steps carrying state); greedy by default.
    Prints text as it comes when the checkpoint has a tokenizer (random weights give gibberish)."""
    import torch

    from ..checkpoint.config_source import config_of
    from ..runtime.eager import eager_generate, load_for
    from ..text.prompt import Sampling, prepare

    p = prepare(checkpoint, config_of(None, checkpoint).vocab_size, prompt, prompt_ids, chat,
                Sampling(max_new_tokens, temperature, top_k, top_p, seed))
    with timed(f"load {checkpoint}"):
        model = load_for(checkpoint, batch=1, prompt_len=len(p.ids), new_tokens=max_new_tokens)
    printer = Printer(p.tokenizer, p.options.eos_token_ids)
    try:
        g = eager_generate(model, torch.tensor([p.ids]), p.options, printer, cuda_graph)
    except ValueError as e:
        fail(f"generate: {one_line(e)}")
    printer.finish(g, len(p.ids), "eager, cuda graph" if cuda_graph else "eager, cpu")


@app.command()
def run(export_dir: ExportDir, backend: RunBackend = Backend.ORT, prompt: PromptText = None,
        prompt_ids: PromptIds = None, chat: Chat = False, max_new_tokens: MaxNewTokens = 16,
        temperature: Temperature = 0.0, top_k: TopK = 0, top_p: TopP = 1.0, seed: SamplerSeed = None,
        provider: OrtProvider = Provider.AUTO, skip_hash_check: SkipHashCheck = False,
        cuda_graph: CudaGraph = False, prompts: PromptsFile = None, max_sequences: MaxSequences = 8,
        cache_blocks: CacheBlocks = None, max_step_tokens: MaxStepTokens = 512, json_out: JsonOut = None,
        save_state: SaveState = None, load_state: LoadState = None, prefix_cache: PrefixCache = False,
        prefix_cache_mb: PrefixCacheMB = 1024.0, speculate: Speculate = None, draft: Draft = None,
        speculate_tokens: SpeculateTokens = 4) -> None:
    """Decode with an exported artifact: prefill, then decode steps carrying state; greedy by default.
    Prints text as it comes when the export folder has a tokenizer (random weights give gibberish).
    A serving export (export --serving) serves --prompts FILE (or the one prompt) by continuous batching,
    optionally with a prefix cache and speculating (--speculate ngram:K, or --draft EXPORT --speculate-tokens K;
    greedy). --save-state / --load-state hand a sequence's state from the prefill to a decode in another process."""
    import torch

    from ..folder.artifacts import ExportFolder
    from ..runtime import session as sessions
    from ..runtime.runners import RunnerError
    from ..runtime.state_file import state_hooks
    from ..text.prompt import Sampling, prepare

    folder = ExportFolder.open(export_dir)
    debug("export %s: %s, artifacts %s", export_dir, folder.config().name, ", ".join(folder.manifest["artifacts"]))
    p = prepare(export_dir, folder.config().vocab_size, prompt, prompt_ids, chat,
                Sampling(max_new_tokens, temperature, top_k, top_p, seed), folder.tokenizer_files())
    if save_state is not None or load_state is not None:
        _check_state_flags(export_dir, folder, prompts, load_state, load_state is not None and (prompt or prompt_ids),
                           prefix_cache and load_state is not None)
    if prompts is not None or "serving" in folder.manifest:  # continuous batching (cli/serve.py), any rank count
        from ..runtime.runners import serving_entry
        from ..runtime.serve import ServeOptions
        from .serve import Speculation, read_prompts, run_prompts

        block = int(serving_entry(folder)["block_size"])  # refused here, and the prompts read, before ranks spawn
        ids = [p.ids] if prompts is None else read_prompts(prompts, p.tokenizer, folder.config().vocab_size)
        files = (save_state, load_state) if save_state is not None or load_state is not None else None
        names, notes = ranks_here(export_dir, [backend.value], default_ort=True)
        return run_prompts(folder, ids, p, (names[0], notes), ServeOptions(
            max_sequences, cache_blocks, block, max_step_tokens, prefix_cache=prefix_cache,
            prefix_cache_bytes=int(prefix_cache_mb * 1e6) if prefix_cache else 0), json_out,
            runner_options(provider, skip_hash_check), Speculation(speculate, draft, speculate_tokens), files)
    if speculate is not None or draft is not None:
        fail("--speculate / --draft: speculative decoding needs a serving export (export --serving)")
    try:  # a state file is checked before any runner loads
        ids, state = state_hooks(save_state, load_state, folder.state_contract(), folder.config(), p.ids)
    except RunnerError as e:
        fail(str(e))
    s = open_session(export_dir, [backend.value], runner_options(provider, skip_hash_check, cuda_graph=cuda_graph),
                     default_ort=True)
    (name,) = s.runners
    try:
        sessions.check(s, batch=1, prompt_len=len(ids), new_tokens=max_new_tokens, backends=[name])
        runner = s.runners[name]
        if s.speaks:
            echo(f"backend {name}" + (f" on {runner.provider}" if hasattr(runner, "provider") else ""))
        printer = Printer(p.tokenizer if s.speaks else None, p.options.eos_token_ids)
        g = sessions.decode(s, name, torch.tensor([ids]), p.options, on_token=printer, **state)
    except RunnerError as e:
        fail(f"{s.who}{e}")
    except Exception as e:  # noqa: BLE001 - one line (per rank), no traceback
        fail(f"{s.who}backend {name}: {one_line(e)}")
    if s.speaks:
        printer.finish(g, len(ids), s.describe(name) + (f", state from {load_state}" if load_state else ""))
    close_session(s)


def _check_state_flags(export_dir: Path, folder, prompts: Path | None, load: Path | None, prompt_given, cached
                       ) -> None:
    """--save-state / --load-state: one sequence of one program (batch interface or serving step), or of rank
    programs of a serving step (one file per rank: every rank's file of --load-state must be there)."""
    from ..runtime import session as sessions
    from ..runtime.state_file import Shard, shard_path

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


@app.command()
def logits(out: LogitsOut, checkpoint: Checkpoint = None, input_ids: InputIds = None, batch_file: BatchFile = None,
           backend: LogitsBackend = Backend.EAGER, export_dir: LogitsExportDir = None,
           provider: OrtProvider = Provider.AUTO, skip_hash_check: SkipHashCheck = False) -> None:
    """Full-sequence logits, for parity checks by anyone."""
    if (input_ids is None) == (batch_file is None):
        fail("give exactly one of --input-ids or --batch-file")
    if backend == Backend.EAGER and checkpoint is None:
        fail("backend eager needs --checkpoint DIR")
    if backend != Backend.EAGER and export_dir is None:
        fail(f"backend {backend.value} needs --export-dir DIR")
    import numpy as np
    import torch

    from ..folder.artifacts import ExportFolder
    from ..runtime.eager import checkpoint_logits
    from ..runtime.logits import export_logits, read_ids_npy, save_npy
    from ..text.prompt import parse_ids

    ids = torch.from_numpy((np.array([parse_ids(input_ids, "--input-ids")]) if input_ids
                            else read_ids_npy(batch_file)).astype(np.int64))
    with timed(f"logits {list(ids.shape)} ({backend.value})"):
        result = (checkpoint_logits(checkpoint, ids) if backend == Backend.EAGER else
                  export_logits(ExportFolder.open(export_dir), backend.value, ids,
                                runner_options(provider, skip_hash_check)))
    try:
        save_npy(out, result.numpy())
    except OSError as e:
        fail(f"{out}: cannot write ({e})")
    echo(f"wrote logits {list(result.shape)} float32 to {out}")
