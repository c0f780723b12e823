"""A decode request's prompt and sampling options, as `k3x generate` / `k3x run` take them: prompt ids from
comma-separated ids or from text through the folder's tokenizer (optionally in its chat template), checked
against the model's vocabulary, and SamplingOptions with the folder's EOS ids. Errors are PromptError (one
line naming the flag or file) or TokenizerError.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Collection

from .sampling import SamplingOptions
from .tokenizer import Tokenizer, eos_token_ids, find_tokenizer


class PromptError(ValueError):
    """A prompt or sampling flag that cannot be used; the message names it."""


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
    tokenizer: Tokenizer | None
    options: SamplingOptions


def parse_ids(text: str, what: str) -> list[int]:
    """Comma-separated token ids; `what` names the flag in the error."""
    parts = [x.strip() for x in text.split(",") if x.strip()]
    long = next((x for x in parts if len(x.lstrip("+-")) > 19), None)  # no token id has more digits than 2**64
    if long is not None:
        raise PromptError(f"{what}: an id of {len(long):,} characters ({long[:20]}...); token ids are at most 19 digits")
    try:
        ids = [int(x) for x in parts]
    except ValueError:
        raise PromptError(f"{what}={text[:80]!r}: expected comma-separated integers, e.g. 1,2,3") from None
    if not ids:
        raise PromptError(f"{what}: no token ids given")
    return ids


def prepare(folder: Path, vocab_size: int, prompt: str | None, prompt_ids: str | None, chat: bool,
            sampling: Sampling, listed: Collection[str] | None = None) -> Prepared:
    """Prompt ids (from `prompt_ids`, or `prompt` through the folder's tokenizer) and sampling options.
    `listed`: the folder is an export; only these (hash-checked) tokenizer files are read."""
    if prompt is not None and prompt_ids is not None:
        raise PromptError("give one of --prompt TEXT or --prompt-ids IDS, not both")
    if chat and prompt is None:
        raise PromptError("--chat applies the chat template to --prompt TEXT; give --prompt")
    tokenizer = find_tokenizer(folder, listed)
    if prompt is None:
        ids = parse_ids(prompt_ids or "1,2,3", "--prompt-ids")
    elif tokenizer is None:
        raise PromptError(f"{folder}: no tokenizer (tokenizer.json or tiktoken.model) for --prompt; use --prompt-ids")
    else:
        ids = tokenizer.encode(tokenizer.chat_prompt(prompt) if chat else prompt)
        if not ids:
            raise PromptError("--prompt: the text encodes to no tokens")
    eos = tokenizer.eos_token_ids if tokenizer else eos_token_ids(folder, listed=listed)
    if max(ids) >= vocab_size or min(ids) < 0:
        raise PromptError(f"prompt: token ids must be in [0, {vocab_size}), got [{min(ids)}, {max(ids)}]"
                          + (" (does the tokenizer belong to this model?)" if prompt is not None else ""))
    if sampling.seed is not None and sampling.temperature == 0:  # the API takes it (OpenAI's clients send one)
        raise PromptError("--seed applies only when sampling: give --temperature > 0 (greedy decoding is "
                          "deterministic without one)")
    try:
        options = SamplingOptions(sampling.max_new_tokens, sampling.temperature, sampling.top_k, sampling.top_p,
                                  sampling.seed, tuple(eos))
    except ValueError as e:
        raise PromptError(f"sampling: {e}") from None
    return Prepared(ids, tokenizer, options)
