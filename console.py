"""What the k3x commands print: one-line errors, user strings with control characters escaped, stage
progress with elapsed time, streamed text, and `-v` debug lines.

Notable choices:
- `fail` cuts messages to MAX_ERROR characters (an error once printed 7.9 MB); it and `echo` escape control
  characters (`printable`): a config's name or a path may carry terminal escape sequences.
- `debug` lines go to the `k3x.cli` logger: shown with `k3x -v` only (app.py sets the level), on stderr.
- `Printer` streams the text of generated tokens as they come (special tokens left out, split UTF-8 held
  back: text/tokenizer.TextStream), then prints the ids and the timing.
"""

from __future__ import annotations

import contextlib
import logging
import re
import sys
import threading
import time
from typing import Any, Iterator

import typer

MAX_ERROR = 2000
log = logging.getLogger("k3x.cli")

# C0 / C1 control characters but newline and tab, and the bidi overrides that reorder what a terminal shows
_CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028\u2029\u202a-\u202e\u2066-\u2069]")


def printable(text: str) -> str:
    """`text` with control characters shown escaped (`\\x1b`): a name or path from a config can hold
    terminal escape sequences, which must never reach the terminal raw."""
    return _CONTROL.sub(lambda m: ascii(m[0])[1:-1], text)


def echo(text: str, err: bool = False) -> None:
    """typer.echo of text that may hold user strings (config names, paths), control characters escaped."""
    typer.echo(printable(text), err=err)


def fail(message: str) -> None:
    """Print an error that names the bad input and exit 1 (cut to MAX_ERROR characters, control characters
    escaped)."""
    if len(message) > MAX_ERROR:
        message = message[:MAX_ERROR] + f"... ({len(message)} characters in all)"
    typer.secho(f"error: {printable(message)}", fg=typer.colors.RED, err=True)
    raise typer.Exit(code=1)


def one_line(e: BaseException) -> str:
    """`Type: first line of the message` (a runtime's own errors can be pages long)."""
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0][:300] if lines else ''}"


def debug(message: str, *args: Any) -> None:
    """A `-v` line (stages, paths, timings); user strings escaped."""
    log.debug(printable(message % args if args else message))


@contextlib.contextmanager
def timed(what: str) -> Iterator[None]:
    """`-v`: `what ...` before and `what: S s` after the block."""
    debug("%s ...", what)
    start = time.perf_counter()
    yield
    debug("%s: %.2f s", what, time.perf_counter() - start)


class Progress:
    """`[stage] ...` / `[stage] done in S s`, plus `[stage] still running, S s` every TICK_S seconds of a long stage."""

    TICK_S = 15.0

    def __call__(self, stage: str, seconds: float | None) -> None:
        with self.lock:
            self.stage, self.start = (stage, time.perf_counter()) if seconds is None else (None, 0.0)
        typer.echo(f"[{stage}] " + ("..." if seconds is None else f"done in {seconds:.1f} s"))

    def _tick(self) -> None:
        while not self.stop.wait(self.TICK_S):
            with self.lock:
                if self.stage is not None:
                    typer.echo(f"[{self.stage}] still running, {time.perf_counter() - self.start:.0f} s")

    def __enter__(self) -> Progress:
        self.lock, self.stop, self.stage, self.start = threading.Lock(), threading.Event(), None, 0.0
        self.thread = threading.Thread(target=self._tick, daemon=True)
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join()


class Printer:
    """`on_token` for the decode loop: streams text (batch of one) when there is a tokenizer."""

    def __init__(self, tokenizer: Any, eos_token_ids: tuple[int, ...] = ()) -> None:
        self.stream = tokenizer.stream() if tokenizer is not None else None
        self.eos = set(eos_token_ids)

    def __call__(self, token) -> None:
        if self.stream is not None:
            sys.stdout.write(printable(self.stream.push(int(token[0]))))  # a token may decode to an escape
            sys.stdout.flush()

    def finish(self, generation, prompt_len: int, where: str) -> None:
        if self.stream is not None:
            typer.echo(printable(self.stream.flush()))
        tokens = generation.tokens[0].tolist()
        typer.echo("tokens: " + ",".join(str(t) for t in tokens)
                   + (f" (stopped at end-of-sequence token {tokens[-1]})" if tokens and tokens[-1] in self.eos else ""))
        g = generation
        rate = f"{g.decode_tokens_per_s:.1f} tokens/s" if g.tokens.shape[1] > 1 and g.decode_s > 0 else "n/a"
        typer.echo(f"prefill {g.prefill_s * 1e3:.1f} ms ({prompt_len / g.prefill_s:.1f} tokens/s); "
                   f"decode {rate} ({where})")
