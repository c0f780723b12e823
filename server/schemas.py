"""The request bodies of the OpenAI API as k3x serves them (pydantic: a wrong type or a value out of range is a
400 naming the field).

- `prompt`: text, token ids, or a list of either (one choice per prompt); `messages`: text content only.
- `n` must be 1; `max_tokens` >= 1 (completions default 16, as OpenAI's; chat: the room left in the context);
  `temperature` defaults to 1.0 (OpenAI's); under temperature 0 (greedy) `top_p` / `top_k` are ignored, as
  vLLM does; `top_k` 0 or -1 is off; `stop`: a string or up to 4 of them.
- Unknown fields are ignored (clients send `user`, `logprobs: null`, ...); nothing names a file.
"""

from __future__ import annotations

from typing import Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr, field_validator

MAX_STOP = 4
MAX_STOP_CHARS = 256


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: StrictStr
    max_tokens: Optional[StrictInt] = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0, le=100, allow_inf_nan=False)
    top_p: float = Field(1.0, gt=0, le=1, allow_inf_nan=False)
    top_k: StrictInt = Field(0, ge=-1)
    seed: Optional[StrictInt] = Field(None, ge=-(1 << 63), lt=1 << 64)
    stop: Union[StrictStr, list[StrictStr], None] = None
    stream: bool = False
    n: StrictInt = Field(1, ge=1, le=1)
    return_token_ids: bool = False  # vLLM's: the prompt's and each choice's token ids in the response
    stream_options: Optional[dict] = None  # {"include_usage": bool}

    @field_validator("stop")
    @classmethod
    def _stops(cls, v):
        stops = [v] if isinstance(v, str) else list(v or [])
        if len(stops) > MAX_STOP or any(not s or len(s) > MAX_STOP_CHARS for s in stops):
            raise ValueError(f"at most {MAX_STOP} non-empty strings of at most {MAX_STOP_CHARS} characters")
        return stops

    def include_usage(self) -> bool:
        return bool((self.stream_options or {}).get("include_usage"))


class CompletionRequest(_Sampling):
    prompt: Union[StrictStr, list[StrictInt], list[StrictStr], list[list[StrictInt]]]

    @field_validator("prompt")
    @classmethod
    def _not_empty(cls, v):
        if v == "" or v == [] or (isinstance(v, list) and any(p == "" or p == [] for p in v)):
            raise ValueError("a prompt must hold at least one token")
        return v

    def prompts(self) -> list[Union[str, list[int]]]:
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        return list(p)


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: StrictStr


class ChatRequest(_Sampling):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: Optional[StrictInt] = Field(None, ge=1)  # the newer name of max_tokens

    def limit(self) -> Optional[int]:
        return self.max_completion_tokens or self.max_tokens
