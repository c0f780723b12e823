"""The decoding side of `k3x generate` / `k3x run`: sampling flags, the prompt (ids, text, chat), streamed text.

Both commands take the same flags (the `Annotated` aliases below) and go through `prepare` (prompt ids,
tokenizer, sampling options with the folder's EOS ids) and `Printer` (streams decoded text while tokens
come when the folder holds a tokenizer, control characters escaped, then prints the ids and the timing).
Errors are one line naming the flag or file (`cli.fail`).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from .cli_support import printable

PromptIds = Annotated[Optional[str], typer.Option(help="Comma-separated prompt token ids (default 1,2,3).")]
PromptText = Annotated[Optional[str], typer.Option("--prompt", help="Prompt text (needs a tokenizer in the folder).")]
Chat = Annotated[bool, typer.Option("--chat", help="Wrap --prompt in the tokenizer's chat template.")]
MaxNewTokens = Annotated[int, typer.Option(min=1, help="Most tokens to generate (stops earlier on EOS).")]
Temperature = Annotated[float, typer.Option(help="0 = greedy (default); > 0 samples at this temperature.")]
TopK = Annotated[int, typer.Option(min=0, help="Sample among the k most likely tokens (0 = off).")]
TopP = Annotated[float, typer.Option(help="Sample among the smallest set of tokens whose probability sum reaches "
                                          "this (1 = off).")]
Seed = Annotated[Optional[int], typer.Option(help="Seed of the sampler (default: random).")]


@dataclass(frozen=True)
class Sampling:
    """The sampling flags as given (checked by SamplingOptions in `prepare`)."""

    max_new_tokens: int
    temperature: float
    top_k: int
    top_p: float
    seed: int | None


@dataclass
class Prepared:
    ids: list[int]
    tokenizer: Any  # text.tokenizer.Tokenizer | None
    options: Any  # text.sampling.SamplingOptions


def prepare(folder: Path, vocab_size: int, prompt: str | None, prompt_ids: str | None, chat: bool,
            sampling: Sampling, export: Any = None) -> Prepared:
    """Prompt ids (from --prompt-ids, or --prompt through the folder's tokenizer) and sampling options.
    `export` (an ExportFolder): the folder is an export; only its manifest's hash-checked tokenizer files are read."""
    from .cli_support import fail, parse_ids
    from .folder.artifacts import ManifestError
    from .text.sampling import SamplingOptions
    from .text.tokenizer import TokenizerError, eos_token_ids, find_tokenizer

    if prompt is not None and prompt_ids is not None:
        fail("give one of --prompt TEXT or --prompt-ids IDS, not both")
    if chat and prompt is None:
        fail("--chat applies the chat template to --prompt TEXT; give --prompt")
    try:
        listed = None if export is None else export.tokenizer_files()
        tokenizer = find_tokenizer(folder, listed)
        if prompt is not None:
            if tokenizer is None:
                fail(f"{folder}: no tokenizer (tokenizer.json or tiktoken.model) for --prompt; use --prompt-ids")
            ids = tokenizer.encode(tokenizer.chat_prompt(prompt) if chat else prompt)
            if not ids:
                fail("--prompt: the text encodes to no tokens")
        else:
            ids = parse_ids(prompt_ids or "1,2,3", "--prompt-ids")
        eos = tokenizer.eos_token_ids if tokenizer else eos_token_ids(folder, listed=listed)
    except (TokenizerError, ManifestError) as e:
        fail(str(e))
    if max(ids) >= vocab_size or min(ids) < 0:
        fail(f"prompt: token ids must be in [0, {vocab_size}), got [{min(ids)}, {max(ids)}]"
             + (" (does the tokenizer belong to this model?)" if prompt is not None else ""))
    try:
        options = SamplingOptions(sampling.max_new_tokens, sampling.temperature, sampling.top_k, sampling.top_p,
                                  sampling.seed, tuple(eos))
    except ValueError as e:
        fail(f"sampling: {e}")
    return Prepared(ids, tokenizer, options)


class Printer:
    """`on_token` for the decode loop: streams text (batch of one) when there is a tokenizer."""

    def __init__(self, tokenizer: Any) -> None:
        self.stream = tokenizer.stream() if tokenizer is not None else None

    def __call__(self, token) -> None:
        if self.stream is not None:
            sys.stdout.write(printable(self.stream.push(int(token[0]))))  # a token may decode to an escape
            sys.stdout.flush()

    def finish(self, generation, prompt_len: int, where: str) -> None:
        if self.stream is not None:
            typer.echo(printable(self.stream.flush()))
        typer.echo("tokens: " + ",".join(str(t) for t in generation.tokens[0].tolist()))
        g = generation
        rate = f"{g.decode_tokens_per_s:.1f} tokens/s" if g.tokens.shape[1] > 1 and g.decode_s > 0 else "n/a"
        typer.echo(f"prefill {g.prefill_s * 1e3:.1f} ms ({prompt_len / g.prefill_s:.1f} tokens/s); "
                   f"decode {rate} ({where})")
