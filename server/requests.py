"""From an HTTP request to engine jobs: the body read under a size limit, parsed and validated, the prompts
turned into token ids and checked against the context, the cache and the vocabulary (each refusal a 400
naming the field), the sampling options made.

- Body: at most `max_body` bytes (413 past it, counted as it arrives, whatever Content-Length says); JSON.
- Text prompts and chat messages need the export's tokenizer (400 naming `prompt` / `messages` without one);
  chat renders the export's chat template (text/chat_template.py: a bounded child process, off the event
  loop). Stop strings need the tokenizer too (they are matched in the text).
- Limits: a prompt plus `max_tokens` must fit the context (the model's max_position_embeddings) and the MLA
  cache (`--cache-blocks` blocks); chat without max_tokens gets the room left, up to the cache's.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ValidationError

from ..runtime.engine_loop import Job
from ..text.sampling import SamplingOptions
from .errors import ApiError, from_validation
from .schemas import ChatRequest, CompletionRequest

DEFAULT_MAX_TOKENS = 16  # completions, as OpenAI's


@dataclass(frozen=True)
class Limits:
    context: int  # positions a sequence may reach (the model's)
    cache_positions: int  # positions the MLA cache can ever give one sequence
    vocab_size: int
    max_body: int  # bytes
    greedy_only: bool = False  # speculative decoding: temperature 0 only

    @property
    def positions(self) -> int:
        return min(self.context, self.cache_positions)


async def read_json(request, limit: int) -> Any:
    """The body as JSON (413 past `limit` bytes, 400 when not JSON)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise ApiError(413, f"body: {int(declared):,} bytes; at most {limit:,}", None, "body_too_large")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise ApiError(413, f"body: more than {limit:,} bytes", None, "body_too_large")
    try:
        return json.loads(body)
    except (ValueError, UnicodeDecodeError) as e:
        raise ApiError(400, f"body: not valid JSON ({str(e)[:80]})", None, "invalid_json") from None


def validate(model: type[BaseModel], data: Any) -> Any:
    if not isinstance(data, dict):
        raise ApiError(400, "body: expected a JSON object", None, "invalid_type")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise from_validation(e) from None


def prompt_ids(prompts: list, tokenizer, vocab_size: int) -> list[list[int]]:
    ids = []
    for p in prompts:
        if isinstance(p, str):
            if tokenizer is None:
                raise ApiError(400, "prompt: this export has no tokenizer; give token ids", "prompt")
            p = tokenizer.encode(p)
            if not p:
                raise ApiError(400, "prompt: the text encodes to no tokens", "prompt")
        if min(p) < 0 or max(p) >= vocab_size:
            raise ApiError(400, f"prompt: token ids must be in [0, {vocab_size})", "prompt")
        ids.append(list(p))
    return ids


async def chat_ids(req: ChatRequest, tokenizer, vocab_size: int) -> list[int]:
    if tokenizer is None or not tokenizer.chat_template:
        raise ApiError(400, "messages: this export has no chat template; use /v1/completions", "messages")
    from ..text.tokenizer import TokenizerError

    try:
        text = await asyncio.to_thread(tokenizer.chat_messages, [m.model_dump() for m in req.messages])
    except TokenizerError as e:
        raise ApiError(400, f"messages: {e}", "messages") from None
    return prompt_ids([text], tokenizer, vocab_size)[0]


def jobs(req: CompletionRequest | ChatRequest, prompts: list[list[int]], limits: Limits, eos: tuple[int, ...],
         tokenizer, max_tokens: int | None) -> list[Job]:
    """One engine job per prompt (400 naming `prompt`, `max_tokens` or `stop` when it cannot be served)."""
    if limits.greedy_only and req.temperature > 0:
        raise ApiError(400, "temperature: this server decodes speculatively, greedy only (give temperature 0)",
                       "temperature")
    if req.stop and tokenizer is None:
        raise ApiError(400, "stop: this export has no tokenizer to match stop strings in", "stop")
    out = []
    for p in prompts:
        if len(p) >= limits.positions:
            raise ApiError(400, f"prompt: {len(p)} tokens; this server takes at most {limits.positions - 1} "
                           f"(context {limits.context}, cache {limits.cache_positions} positions)", "prompt",
                           "context_length_exceeded")
        n = max_tokens if max_tokens is not None else limits.positions - len(p)
        if len(p) + n - 1 > limits.positions:
            raise ApiError(400, f"max_tokens: {len(p)} prompt tokens + {n} new ones exceed the "
                           f"{limits.positions} positions a sequence may reach", "max_tokens",
                           "context_length_exceeded")
        greedy = req.temperature == 0
        sampling = SamplingOptions(n, req.temperature, 0 if greedy or req.top_k < 0 else req.top_k,
                                   1.0 if greedy else req.top_p, req.seed, eos)
        out.append(Job(tuple(p), n, sampling, tuple(req.stop or ())))
    return out
