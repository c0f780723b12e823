"""The serving side of the k3x CLI (helpers of `run` and `inspect`): `k3x run EXPORT --prompts FILE`
(continuous batching over a serving export) and the pool memory `k3x inspect --context N --sequences S` prints.

- FILE holds one prompt per line: token ids (`1,2,3`) or text (through the folder's tokenizer); line i is
  record i of `--json OUT` (input order), whatever order the sequences finished in.
- A serving export run without --prompts (`--prompt` / `--prompt-ids`) is served as a file of one prompt.
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


def run_prompts(export_dir: Path, prompts: list[list[int]] | Path, prepared, backend: str,
                limits: tuple[int, int | None, int], json_out: Path | None, runner_options,
                spec: Speculation = Speculation(None, None, 4)) -> None:
    """Serve the prompts (a file, or ids) with the export's serving step; print and optionally write records.
    `limits`: --max-sequences, --cache-blocks, --max-step-tokens."""
    import json

    from ..folder.artifacts import ExportFolder
    from ..runtime.runners import RunnerError, serving_entry
    from ..runtime.serve import ServeOptions, serve, serving_runner

    folder = ExportFolder.open(export_dir)
    cfg, tok = folder.config(), prepared.tokenizer
    if isinstance(prompts, Path):
        prompts = read_prompts(prompts, tok, cfg.vocab_size)
    try:
        block = int(serving_entry(folder)["block_size"])
        options = ServeOptions(limits[0], limits[1], block, limits[2])
        drafter = make_drafter(spec, backend, runner_options, cfg.vocab_size)
        runner = serving_runner(backend, folder, runner_options)
        records = serve(runner, cfg, prompts, prepared.options, options, dtype=folder.dtype(), drafter=drafter)
    except (RunnerError, ValueError) as e:
        fail(str(e))
    except Exception as e:  # noqa: BLE001 - one line, no traceback
        fail(f"backend {backend}: {one_line(e)}")
    out = [{"index": r.index, "prompt_tokens": len(r.prompt), "tokens": r.tokens,
            **({"text": tok.decode(r.tokens)} if tok is not None else {}),
            **({"steps": r.counts.steps, "drafted": r.counts.drafted, "accepted": r.counts.accepted}
               if drafter is not None else {})} for r in records]
    for rec in out:
        echo(f"[{rec['index']}] tokens: " + ",".join(map(str, rec["tokens"]))
                   + (f"  {rec['text']!r}" if "text" in rec else ""))
    if drafter is not None:
        echo(speculation_line(records))
    if json_out is not None:
        from ..folder.artifacts import atomic_write_bytes

        atomic_write_bytes(json_out, (json.dumps(out, indent=1) + "\n").encode())


def speculation_line(records) -> str:
    from ..runtime.speculate import Counts

    total = Counts()
    for r in records:
        total.add(r.counts)
    return (f"speculation: {total.accepted}/{total.drafted} drafts accepted ({total.acceptance:.1%}), "
            f"{total.tokens_per_step:.2f} tokens per step ({total.tokens} tokens in {total.steps} sequence-steps)")


def print_pools(cfg, context: int, sequences: int, block_size: int = 16) -> None:
    """`k3x inspect --context N --sequences S`: pool memory of a serving deployment (bf16 latents)."""
    from ..model.state import pool_bytes
    from ..model.summary import format_pools

    echo(format_pools(pool_bytes(cfg, context, sequences, block_size)))
