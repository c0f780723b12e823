"""The serving side of the k3x CLI (helpers of `run` and `inspect`): `k3x run EXPORT --prompts FILE`
(continuous batching over a serving export) and the pool memory `k3x inspect --context N --sequences S` prints.

- FILE holds one prompt per line: token ids (`1,2,3`) or text (through the folder's tokenizer); line i is
  record i of `--json OUT` (input order), whatever order the sequences finished in.
- A serving export run without --prompts (`--prompt` / `--prompt-ids`) is served as a file of one prompt.
- `--prefix-cache`: prompts sharing a prefix reuse its cached state; the hit rate and the prefill tokens saved
  are printed, and every --json record has `cached_tokens` (prompt tokens taken from the cache).
- Errors name the file and line, or the flag; nothing is written on failure (`--json` is renamed into place).
"""

from __future__ import annotations

import re
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


def run_prompts(export_dir: Path, prompts: list[list[int]] | Path, prepared, backend: str,
                limits: tuple[int, int | None, int], json_out: Path | None, runner_options, *,
                prefix_cache: int | None = None) -> None:
    """Serve the prompts (a file, or ids) with the export's serving step; print and optionally write records.
    `limits`: --max-sequences, --cache-blocks, --max-step-tokens; `prefix_cache`: its budget in bytes (None: off)."""
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
        options = ServeOptions(limits[0], limits[1], block, limits[2], prefix_cache=prefix_cache is not None,
                               prefix_cache_bytes=prefix_cache or 0)
        runner = serving_runner(backend, folder, runner_options)
        records = serve(runner, cfg, prompts, prepared.options, options, dtype=folder.dtype())
    except (RunnerError, ValueError) as e:
        fail(str(e))
    except Exception as e:  # noqa: BLE001 - one line, no traceback
        fail(f"backend {backend}: {one_line(e)}")
    out = [{"index": r.index, "prompt_tokens": len(r.prompt), "tokens": r.tokens,
            **({"cached_tokens": r.cached} if prefix_cache is not None else {}),
            **({"text": tok.decode(r.tokens)} if tok is not None else {})} for r in records]
    for rec in out:
        echo(f"[{rec['index']}] tokens: " + ",".join(map(str, rec["tokens"]))
                   + (f"  {rec['text']!r}" if "text" in rec else ""))
    if prefix_cache is not None:
        echo(prefix_line(records))
    if json_out is not None:
        from ..folder.artifacts import atomic_write_bytes

        atomic_write_bytes(json_out, (json.dumps(out, indent=1) + "\n").encode())


def prefix_line(records) -> str:
    """The prefix cache's figures of a run: requests that hit, and prompt tokens taken from the cache."""
    hits, prompt = sum(r.cached > 0 for r in records), sum(len(r.prompt) for r in records)
    saved = sum(r.cached for r in records)
    return (f"prefix cache: {hits}/{len(records)} requests hit ({100 * hits / len(records):.0f} %), "
            f"{saved:,} of {prompt:,} prompt tokens from the cache, {prompt - saved:,} prefilled")


def print_pools(cfg, context: int, sequences: int, block_size: int = 16) -> None:
    """`k3x inspect --context N --sequences S`: pool memory of a serving deployment (bf16 latents)."""
    from ..model.state import pool_bytes
    from ..model.summary import format_pools

    echo(format_pools(pool_bytes(cfg, context, sequences, block_size)))
