"""Offline serving, `k3x run EXPORT --prompts FILE`: the prompts served together by continuous batching over a
serving export's step (one program, or inside a launcher this rank's), the records printed and optionally
written by the speaking rank.

- Line i of FILE is record i - 1 of `--json OUT` (input order), whatever order the sequences finished in; a
  request's `max_tokens` (a .jsonl line's) replaces --max-new-tokens for it. Every bound (the flags against the
  export's traced maxima, each request against the model's context) is checked before anything loads
  (runtime/serve_bounds.py).
- `--json OUT` is written under fileio.write_output's rule; `--json -` streams the records to standard
  output (then the per-record lines are not printed: the JSON holds them).
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
from .serve_bounds import Served


@dataclass(frozen=True)
class Speculation:
    ngram: str | None  # --speculate ngram:K
    draft: Path | None  # --draft EXPORT
    tokens: int  # --speculate-tokens (with --draft)

    def draft_tokens(self) -> int:
        """Draft tokens per step (0: no speculation); ValueError names a bad --speculate."""
        from .speculate import parse_speculate

        return parse_speculate(self.ngram) if self.ngram else self.tokens if self.draft else 0


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
    if "serving" not in folder.manifest:
        raise ValueError(f"--draft {spec.draft}: not a serving export (export --serving)")
    cfg = folder.config()
    if cfg.vocab_size != vocab_size:
        raise ValueError(f"--draft {spec.draft}: vocabulary of {cfg.vocab_size} tokens, the export's has {vocab_size}")
    return ModelDrafter(serving_runner(backend, folder, runner_options), cfg, spec.tokens,
                        block_size=int(serving_entry(folder)["block_size"]), dtype=folder.dtype())


def requests_served(requests, default_new: int, prompts_file: Path | None) -> list[Served]:
    """The requests (text/prompts_file.PromptRequest) with their new tokens and where each came from."""
    return [Served(r.ids, r.max_tokens or default_new,
                   f"--prompts {prompts_file}:{r.line}" if prompts_file is not None else "the prompt",
                   f"{prompts_file}:{r.line}: max_tokens" if r.max_tokens else "--max-new-tokens") for r in requests]


def run_prompts(folder, requests, prepared, backend: tuple[str, list[str]], options,
                output: tuple[Path | None, list, Path | None], runner_options,
                spec: Speculation = Speculation(None, None, 4),
                state_files: tuple[Path | None, Path | None] | None = None) -> None:
    """Serve the requests (text/prompts_file.PromptRequest) with the export's serving step (`options`:
    runtime/serve.ServeOptions), one program or (inside a launcher) this rank's; the speaking rank prints and
    optionally writes the records. `backend`: (name, notes for the user); `output`: (--json OUT, the
    command's (flag, path) inputs it may not replace, --prompts FILE); `spec`: --speculate / --draft;
    `state_files`: (--save-state, --load-state) of the one prompt (runtime/session.serving_state; a loaded
    state replaces the prompt)."""
    from . import session as sessions
    from .runners import RunnerError, serving_entry
    from .serve_bounds import check_serving

    json_out, inputs, prompts_file = output
    served = requests_served(requests, prepared.options.max_new_tokens, prompts_file)
    try:
        drafts = spec.draft_tokens()
    except ValueError as e:
        fail(str(e))
    check_serving(serving_entry(folder), folder.config(), options, served, drafts)  # before anything loads
    prompts, news = [r.ids for r in served], [r.new_tokens for r in served]
    name, notes, tok, s, state = backend[0], backend[1], prepared.tokenizer, None, {}
    try:
        s = sessions.open_serving(folder, name, runner_options)
        if state_files is not None:
            one, state = sessions.serving_state(s, *state_files, prompts[0])
            prompts = [one]
        for line in notes if s.speaks else ():
            echo(line, err=line.startswith("note:"))
        drafter = make_drafter(spec, name, runner_options, folder.config().vocab_size)
        records = sessions.serve_prompts(s, name, prompts, prepared.options, options, drafter=drafter,
                                         max_new_tokens=news, **state)
    except (RunnerError, ValueError) as e:
        fail(f"{s.who if s else ''}{e}")
    except Exception as e:  # noqa: BLE001 - one line (per rank), no traceback
        fail(f"{s.who if s else ''}backend {name}: {one_line(e)}")
    try:
        if s.speaks:
            _report(s, name, records, tok, options, drafter, json_out, inputs)
    finally:
        s.close()


def _report(s, name: str, records, tok, options, drafter, json_out: Path | None, inputs: list) -> None:
    """The speaking rank's lines and `--json` records (to standard output alone with `--json -`)."""
    import json

    from ..fileio import is_stdout, write_output

    streamed = json_out is not None and is_stdout(json_out)
    out = [{"index": r.index, "prompt_tokens": len(r.prompt), "tokens": r.tokens,
            **({"cached_tokens": r.cached} if options.prefix_cache else {}),
            **({"text": tok.decode(r.tokens)} if tok is not None else {}),
            **({"steps": r.counts.steps, "drafted": r.counts.drafted, "accepted": r.counts.accepted}
               if drafter is not None else {})} for r in records]
    for rec in out if not streamed else ():
        echo(f"[{rec['index']}] tokens: " + ",".join(map(str, rec["tokens"]))
             + (f"  {rec['text']!r}" if "text" in rec else ""))
    if options.prefix_cache:
        echo(prefix_line(records), err=streamed)
    if drafter is not None:
        echo(speculation_line(records), err=streamed)
    if s.plan.world > 1:
        echo(f"served on {s.describe(name)}", err=streamed)
    if json_out is not None:
        write_output(json_out, (json.dumps(out, indent=1) + "\n").encode(), flag="--json", inputs=inputs,
                     stream=True)


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
