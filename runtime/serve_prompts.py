"""Offline serving, `k3x run EXPORT --prompts FILE`: the prompts served together by continuous batching over a
serving export's step (one program, or inside a launcher this rank's), the records printed and optionally
written by the speaking rank.

- Line i of FILE is record i of `--json OUT` (input order), whatever order the sequences finished in.
- A rank serving export is served by its ranks; rank 0 prints and writes `--json`. The prefix cache,
  speculation and state files work there too (every rank decides alike from rank 0's tokens; each keeps its own
  pools and snapshots, and writes and reads its own state file, FILE.rank{r}of{W}).
- `--prefix-cache`: the hit rate and the prefill tokens saved are printed, and every record has `cached_tokens`.
- Speculation (`--speculate ngram:K`, `--draft EXPORT --speculate-tokens K`): greedy only; the tokens are those
  of plain greedy decoding; the acceptance rate and tokens per step are printed, and each record carries its
  `steps`, `drafted` and `accepted`.
- Errors name the file and line, or the flag; nothing is written on failure (`--json` is renamed into place).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..console import echo, fail, one_line


@dataclass(frozen=True)
class Speculation:
    ngram: str | None  # --speculate ngram:K
    draft: Path | None  # --draft EXPORT
    tokens: int  # --speculate-tokens (with --draft)


def make_drafter(spec: Speculation, backend: str, runner_options, vocab_size: int):
    """The drafter of --speculate / --draft (None: neither); ValueError / RunnerError name the flag."""
    from .serve import serving_runner
    from .speculate import ModelDrafter, NgramDrafter, parse_speculate

    if spec.ngram is not None and spec.draft is not None:
        raise ValueError("--speculate and --draft: give one of them")
    if spec.ngram is not None:
        return NgramDrafter(parse_speculate(spec.ngram))
    if spec.draft is None:
        return None
    from ..folder.artifacts import ExportFolder
    from .runners import serving_entry

    folder = ExportFolder.open(spec.draft)
    cfg = folder.config()
    if cfg.vocab_size != vocab_size:
        raise ValueError(f"--draft {spec.draft}: vocabulary of {cfg.vocab_size} tokens, the export's has {vocab_size}")
    return ModelDrafter(serving_runner(backend, folder, runner_options), cfg, spec.tokens,
                        block_size=int(serving_entry(folder)["block_size"]), dtype=folder.dtype())


def run_prompts(folder, prompts: list[list[int]], prepared, backend: tuple[str, list[str]], options,
                json_out: Path | None, runner_options, spec: Speculation = Speculation(None, None, 4),
                state_files: tuple[Path | None, Path | None] | None = None) -> None:
    """Serve the prompts (ids) with the export's serving step (`options`: runtime/serve.ServeOptions), one
    program or (inside a launcher) this rank's; the speaking rank prints and optionally writes the records.
    `backend`: (name, notes for the user); `spec`: --speculate / --draft; `state_files`: (--save-state,
    --load-state) of the one prompt (runtime/session.serving_state; a loaded state replaces the prompt)."""
    import json

    from . import session as sessions
    from .runners import RunnerError

    name, notes, tok, s, state = backend[0], backend[1], prepared.tokenizer, None, {}
    try:
        s = sessions.open_serving(folder, name, runner_options)
        if state_files is not None:
            one, state = sessions.serving_state(s, *state_files, prompts[0])
            prompts = [one]
        for line in notes if s.speaks else ():
            echo(line, err=line.startswith("note:"))
        drafter = make_drafter(spec, name, runner_options, folder.config().vocab_size)
        records = sessions.serve_prompts(s, name, prompts, prepared.options, options, drafter=drafter, **state)
    except (RunnerError, ValueError) as e:
        fail(f"{s.who if s else ''}{e}")
    except Exception as e:  # noqa: BLE001 - one line (per rank), no traceback
        fail(f"{s.who if s else ''}backend {name}: {one_line(e)}")
    if s.speaks:
        out = [{"index": r.index, "prompt_tokens": len(r.prompt), "tokens": r.tokens,
                **({"cached_tokens": r.cached} if options.prefix_cache else {}),
                **({"text": tok.decode(r.tokens)} if tok is not None else {}),
                **({"steps": r.counts.steps, "drafted": r.counts.drafted, "accepted": r.counts.accepted}
                   if drafter is not None else {})} for r in records]
        for rec in out:
            echo(f"[{rec['index']}] tokens: " + ",".join(map(str, rec["tokens"]))
                 + (f"  {rec['text']!r}" if "text" in rec else ""))
        if options.prefix_cache:
            echo(prefix_line(records))
        if drafter is not None:
            echo(speculation_line(records))
        if s.plan.world > 1:
            echo(f"served on {s.describe(name)}")
        if json_out is not None:
            from ..folder.artifacts import atomic_write_bytes

            atomic_write_bytes(json_out, (json.dumps(out, indent=1) + "\n").encode())
    s.close()


def speculation_line(records) -> str:
    from .speculate import Counts

    total = Counts()
    for r in records:
        total.add(r.counts)
    return (f"speculation: {total.accepted}/{total.drafted} drafts accepted ({total.acceptance:.1%}), "
            f"{total.tokens_per_step:.2f} tokens per step ({total.tokens} tokens in {total.steps} sequence-steps)")


def prefix_line(records) -> str:
    """The prefix cache's figures of a run: requests that hit, and prompt tokens taken from the cache."""
    hits, prompt = sum(r.cached > 0 for r in records), sum(len(r.prompt) for r in records)
    saved = sum(r.cached for r in records)
    return (f"prefix cache: {hits}/{len(records)} requests hit ({100 * hits / len(records):.0f} %), "
            f"{saved:,} of {prompt:,} prompt tokens from the cache, {prompt - saved:,} prefilled")
