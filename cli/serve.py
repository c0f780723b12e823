"""The serving side of the k3x CLI (helpers of `run` and `inspect`): `k3x run EXPORT --prompts FILE`
(continuous batching over a serving export) and the pool memory `k3x inspect --context N --sequences S` prints.

- FILE holds one prompt per line: token ids (`1,2,3`) or text (through the folder's tokenizer); line i is
  record i of `--json OUT` (input order), whatever order the sequences finished in.
- A serving export run without --prompts (`--prompt` / `--prompt-ids`) is served as a file of one prompt.
- A rank serving export (`--serving --tp/--ep`) is served by its ranks (under torchrun, or started by k3x as
  for every rank export); rank 0 prints and writes `--json`. The prefix cache, speculation and state files work
  there too (every rank decides alike from rank 0's tokens; each keeps its own pools and snapshots, and writes
  and reads its own state file, FILE.rank{r}of{W}).
- `--prefix-cache`: prompts sharing a prefix reuse its cached state; the hit rate and the prefill tokens saved
  are printed, and every --json record has `cached_tokens` (prompt tokens taken from the cache).
- Speculation (`--speculate ngram:K`, `--draft EXPORT --speculate-tokens K`): greedy only; the tokens are
  those of plain greedy decoding; the acceptance rate and tokens per step are printed, and each record of
  `--json` carries its `steps`, `drafted` and `accepted`.
- Errors name the file and line, or the flag; nothing is written on failure (`--json` is renamed into place).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from .console import echo, fail, one_line

_IDS = re.compile(r"\s*\d+(\s*,\s*\d+)*\s*")


def read_prompts(path: Path, tokenizer, vocab_size: int) -> list[list[int]]:
    try:
        lines = Path(path).read_text().splitlines()
    except (OSError, UnicodeDecodeError) as e:
        fail(f"--prompts {path}: cannot read it ({e})")
    if not lines:
        fail(f"--prompts {path}: no prompts (one a line)")
    prompts = []
    for n, line in enumerate(lines, 1):
        if _IDS.fullmatch(line):
            ids = [int(x) for x in line.split(",")]
        elif not line.strip():
            fail(f"{path}:{n}: empty line (one prompt a line)")
        elif tokenizer is None:
            fail(f"{path}:{n}: text prompt, but the export has no tokenizer; write ids as 1,2,3")
        else:
            ids = tokenizer.encode(line)
        if not ids or min(ids) < 0 or max(ids) >= vocab_size:
            fail(f"{path}:{n}: token ids must be in [0, {vocab_size}) and at least one")
        prompts.append(ids)
    return prompts


@dataclass(frozen=True)
class Speculation:
    ngram: str | None  # --speculate ngram:K
    draft: Path | None  # --draft EXPORT
    tokens: int  # --speculate-tokens (with --draft)


def make_drafter(spec: Speculation, backend: str, runner_options, vocab_size: int):
    """The drafter of --speculate / --draft (None: neither); ValueError / RunnerError name the flag."""
    from ..runtime.serve import serving_runner
    from ..runtime.speculate import ModelDrafter, NgramDrafter, parse_speculate

    if spec.ngram is not None and spec.draft is not None:
        raise ValueError("--speculate and --draft: give one of them")
    if spec.ngram is not None:
        return NgramDrafter(parse_speculate(spec.ngram))
    if spec.draft is None:
        return None
    from ..folder.artifacts import ExportFolder
    from ..runtime.runners import serving_entry

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

    from ..runtime import session as sessions
    from ..runtime.runners import RunnerError

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
    from ..runtime.speculate import Counts

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


def print_pools(cfg, context: int, sequences: int, block_size: int = 16, tp: int = 1, ep: int = 1,
                dtype: str = "bf16", chunk: int | None = None) -> None:
    """`k3x inspect --context N --sequences S [--tp T --ep E] [--dtype] [--chunk T]`: pool memory of a serving
    deployment (latents in the model dtype, `dtype`: bf16 | fp32; KDA states are fp32 either way), per rank
    under a plan (its local config: its KDA heads; the latent whole); with `chunk`, the working memory of a
    step of that many tokens (model/working.py) and the peak pools + step."""
    import torch

    from ..model.parallel import ParallelPlan
    from ..model.state import pool_bytes
    from ..model.summary import format_pools

    plan = ParallelPlan(tp, ep)
    torch_dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype]
    local = plan.local_config(cfg)
    pools = pool_bytes(local, context, sequences, block_size, dtype=torch_dtype)
    echo(format_pools(pools, plan))
    if chunk is not None:
        from ..model.summary import format_working
        from ..model.working import step_working_bytes

        echo(format_working(step_working_bytes(local, chunk, block_size, torch_dtype), pools))
