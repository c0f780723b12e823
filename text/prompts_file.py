"""`--prompts FILE`: one prompt a line, token ids (`1,2,3`) or text (through the export's tokenizer); line i is
request i. Errors name the file and line."""

from __future__ import annotations

import re
from pathlib import Path

from ..console import fail

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
