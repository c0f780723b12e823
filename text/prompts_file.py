"""`--prompts FILE`: the requests `k3x run` serves together, one a line; line n (counted as an editor counts
them) is request n - 1 and record n - 1 of `--json`. Two formats, by the file's extension or `--prompts-format`:

- jsonl (`.jsonl`): one JSON object a line, as the OpenAI batch and vLLM offline inputs are:
  `{"prompt": "text"}` (through the export's tokenizer) or `{"prompt_ids": [1, 2, 3]}`, optionally
  `"max_tokens": N` (this request's new tokens; default --max-new-tokens) and the sampling fields
  `temperature`, `top_p`, `top_k`, `seed`: sampling is one for the run, so each must equal the command's
  (--temperature ...) or the line is refused. Any other key is refused.
- text (any other name): each line is text, always, through the export's tokenizer (a line of digits is
  the text of those digits). Token ids are given only in jsonl (`prompt_ids`).

Reading is bounded: a regular file only (a FIFO or a device is refused before it is read, so /dev/zero
cannot hang or fill memory), at most MAX_FILE_BYTES, each line at most MAX_LINE_BYTES; lines split on `\\n`
only (a form feed or `\\x1c` stays inside its line), one trailing `\\r` dropped, a UTF-8 BOM at the start
dropped; an empty line is refused. Errors are PromptError, one line naming the file and line.
"""

from __future__ import annotations

import json
import math
import os
import stat
from dataclasses import dataclass
from pathlib import Path

from .prompt import PromptError
from .sampling import SamplingOptions

MAX_FILE_BYTES = 256 << 20
MAX_LINE_BYTES = 8 << 20  # about two million tokens of text: more than any context
MAX_ID_DIGITS = 19  # a token id fits in 64 bits; longer digit runs are not read as numbers
FORMATS = ("text", "jsonl")
SAMPLING_FIELDS = {"temperature": "--temperature", "top_p": "--top-p", "top_k": "--top-k", "seed": "--seed"}


@dataclass(frozen=True)
class PromptRequest:
    ids: list[int]
    max_tokens: int | None  # None: the command's --max-new-tokens
    line: int  # 1-based, as the user counts


def prompts_format(path: Path, given: str | None) -> str:
    """`given` (--prompts-format), else jsonl for a `.jsonl` file, else text."""
    if given is not None:
        if given not in FORMATS:
            raise PromptError(f"--prompts-format {given!r}: one of {', '.join(FORMATS)}")
        return given
    return "jsonl" if Path(path).suffix.lower() == ".jsonl" else "text"


def read_lines(path: Path) -> list[str]:
    """The file's lines under the reading rules above (PromptError naming the limit or the problem)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # a FIFO opens without waiting for a writer
    except OSError as e:
        raise PromptError(f"--prompts {path}: cannot read it ({e.strerror or e})") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise PromptError(f"--prompts {path}: not a regular file (a FIFO, device or folder is not read)")
    with os.fdopen(fd, "rb") as f:
        if st.st_size > MAX_FILE_BYTES:
            raise PromptError(f"--prompts {path}: {st.st_size:,} bytes, over the limit of {MAX_FILE_BYTES:,}")
        data = f.read(MAX_FILE_BYTES + 1)
    if len(data) > MAX_FILE_BYTES:
        raise PromptError(f"--prompts {path}: over the limit of {MAX_FILE_BYTES:,} bytes")
    data = data.removeprefix(b"\xef\xbb\xbf")
    raw = data.split(b"\n")
    if raw and raw[-1] == b"":
        raw.pop()  # the newline that ends the last line
    lines = []
    for n, line in enumerate(raw, 1):
        if len(line) > MAX_LINE_BYTES:
            raise PromptError(f"{path}:{n}: {len(line):,} bytes, over the line limit of {MAX_LINE_BYTES:,}")
        try:
            lines.append(line.removesuffix(b"\r").decode("utf-8"))
        except UnicodeDecodeError as e:
            raise PromptError(f"{path}:{n}: not UTF-8 ({e.reason} at byte {e.start})") from None
    if not lines:
        raise PromptError(f"--prompts {path}: no prompts (one a line)")
    return lines


def read_prompts(path: Path, tokenizer, vocab_size: int, sampling: SamplingOptions,
                 fmt: str | None = None) -> list[PromptRequest]:
    """The requests of `--prompts path` (format `fmt`, or by the extension), ids checked against the
    vocabulary; sampling fields of a jsonl line checked against the command's `sampling`."""
    kind = prompts_format(path, fmt)
    out = []
    for n, line in enumerate(read_lines(path), 1):
        where = f"{path}:{n}"
        if not line.strip():
            raise PromptError(f"{where}: empty line (one prompt a line)")
        if kind == "text":
            ids, max_tokens = _encode(line, tokenizer, where, "text prompt"), None
        else:
            ids, max_tokens = _json_request(line, tokenizer, sampling, where)
        if not ids:
            raise PromptError(f"{where}: the prompt has no tokens")
        if min(ids) < 0 or max(ids) >= vocab_size:
            raise PromptError(f"{where}: token ids must be in [0, {vocab_size}), got [{min(ids)}, {max(ids)}]")
        out.append(PromptRequest(ids, max_tokens, n))
    return out


def _encode(text: str, tokenizer, where: str, what: str) -> list[int]:
    if tokenizer is None:
        raise PromptError(f"{where}: {what}, but the export has no tokenizer; give ids in a .jsonl file "
                          '({"prompt_ids": [1, 2, 3]})')
    return tokenizer.encode(text)


def _int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_ID_DIGITS:
        raise ValueError(f"the number {text[:20]}... has {len(text)} digits")
    return int(text)


def _no_constant(name: str) -> None:
    raise ValueError(f"{name} is not a JSON number")


def _json_request(line: str, tokenizer, sampling: SamplingOptions, where: str) -> tuple[list[int], int | None]:
    try:
        obj = json.loads(line, parse_int=_int, parse_constant=_no_constant)
    except (ValueError, RecursionError) as e:
        raise PromptError(f"{where}: not a JSON object ({str(e)[:200]})") from None
    if not isinstance(obj, dict):
        raise PromptError(f"{where}: not a JSON object ({{\"prompt\": \"text\"}} or {{\"prompt_ids\": [1, 2]}})")
    unknown = sorted(set(obj) - {"prompt", "prompt_ids", "max_tokens", *SAMPLING_FIELDS})
    if unknown:
        raise PromptError(f"{where}: unknown field {unknown[0][:80]!r} (prompt, prompt_ids, max_tokens, "
                          + ", ".join(SAMPLING_FIELDS) + ")")
    if ("prompt" in obj) == ("prompt_ids" in obj):
        raise PromptError(f"{where}: give one of \"prompt\" (text) or \"prompt_ids\" (token ids)")
    if "prompt" in obj:
        if not isinstance(obj["prompt"], str):
            raise PromptError(f"{where}: \"prompt\" must be a string (ids go in \"prompt_ids\")")
        ids = _encode(obj["prompt"], tokenizer, where, "\"prompt\" is text")
    else:
        ids = obj["prompt_ids"]
        if not isinstance(ids, list) or not all(type(i) is int for i in ids):
            raise PromptError(f"{where}: \"prompt_ids\" must be a list of integers")
    max_tokens = obj.get("max_tokens")
    if max_tokens is not None and (type(max_tokens) is not int or max_tokens < 1):
        raise PromptError(f"{where}: \"max_tokens\" must be an integer >= 1, got {str(max_tokens)[:40]}")
    for name, flag in SAMPLING_FIELDS.items():
        if name in obj and not _same(obj[name], getattr(sampling, name)):
            raise PromptError(f"{where}: \"{name}\": {str(obj[name])[:40]} differs from the run's "
                              f"{flag} {getattr(sampling, name)}; sampling is one for the whole run")
    return ids, max_tokens


def _same(value, want) -> bool:
    if value is None or want is None or isinstance(value, bool):
        return value is want
    if not isinstance(value, (int, float)):
        return False
    return math.isfinite(value) and value == want
