"""A request's choices in flight and the OpenAI response bodies made of their events.

- `Choices` submits one engine job per prompt; the engine thread's events come back on one asyncio queue
  (`loop.call_soon_threadsafe`). Leaving `events()` early (a client gone, an error) cancels the jobs still
  running, so the engine frees their slots and blocks before its next step.
- Latency figures go to the metrics here, from the engine's step timestamps.
- Bodies follow OpenAI's schema (`text_completion`, `chat.completion` and their stream chunks); with
  `return_token_ids` (vLLM's) each choice also carries `prompt_token_ids` and `token_ids`.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import dataclass, field

from ..runtime.engine_loop import Closed, Event, Job, QueueFull
from .errors import ApiError

POLL_S = 0.5  # how often a non-streamed answer checks that its client is still there


@dataclass
class Choice:
    prompt: list[int]
    text: str = ""
    tokens: list[int] = field(default_factory=list)
    finish: str | None = None
    last: float | None = None  # the last event's time


class Choices:
    def __init__(self, service, jobs: list[Job]) -> None:
        self.service, self.metrics = service, service.metrics
        self.queue: asyncio.Queue = asyncio.Queue()
        self.t0 = time.perf_counter()
        self.items = [Choice(list(j.prompt)) for j in jobs]
        self.rids: list[int] = []
        loop = asyncio.get_running_loop()
        for i, job in enumerate(jobs):
            def sink(ev: Event, i: int = i) -> None:
                loop.call_soon_threadsafe(self.queue.put_nowait, (i, ev))
            try:
                self.rids.append(service.loop.submit(job, sink))
            except QueueFull as e:
                self.cancel()
                raise ApiError(503, f"server busy: {e}", None, "queue_full", {"Retry-After": "1"}) from None
            except Closed as e:
                self.cancel()
                raise ApiError(503, str(e), None, "shutting_down", {"Retry-After": "5"}) from None

    @property
    def open(self) -> bool:
        return any(c.finish is None for c in self.items)

    def cancel(self) -> None:
        for rid, c in zip(self.rids, self.items):
            if c.finish is None:
                self.service.loop.cancel(rid)

    def take(self, i: int, ev: Event) -> None:
        c, m = self.items[i], self.metrics
        if ev.prefill is not None:
            m.queue_time.observe(ev.queued)
            m.prefill_time.observe(ev.prefill)
        if ev.tokens:
            if c.last is None:
                m.ttft.observe(ev.t - self.t0)
            else:
                for _ in ev.tokens:
                    m.itl.observe((ev.t - c.last) / len(ev.tokens))
            c.last = ev.t
            m.generation_tokens.inc(len(ev.tokens))
        c.text += ev.text
        c.tokens += ev.tokens
        c.finish = ev.finish
        if ev.finish is not None:
            m.finished.labels(ev.finish).inc()
            m.prompt_tokens.inc(len(c.prompt))
            if ev.finish != "error":
                m.e2e.observe(ev.t - self.t0)

    async def events(self, request=None):
        """(choice index, event) until every choice finished; with `request` (a non-streamed answer), a
        client that went away cancels them."""
        check = time.monotonic() + POLL_S
        try:
            while self.open:
                try:
                    got = await asyncio.wait_for(self.queue.get(), POLL_S)
                except asyncio.TimeoutError:
                    got = None
                if request is not None and time.monotonic() >= check:  # events may never pause: by the clock
                    check = time.monotonic() + POLL_S
                    if await request.is_disconnected():
                        return
                if got is not None:
                    self.take(*got)
                    yield got
        finally:
            self.cancel()


def usage(choices: Choices) -> dict:
    prompt = sum(len(c.prompt) for c in choices.items)
    done = sum(len(c.tokens) for c in choices.items)
    return {"prompt_tokens": prompt, "completion_tokens": done, "total_tokens": prompt + done}


def sse(data: dict | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data, separators=(',', ':'))}\n\n"


class Format:
    """The bodies of one endpoint: `completion` (text_completion) or `chat` (chat.completion)."""

    def __init__(self, kind: str, model: str, token_ids: bool) -> None:
        self.kind, self.model, self.token_ids = kind, model, token_ids
        self.id = ("cmpl-" if kind == "completion" else "chatcmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.started: set[int] = set()

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def _ids(self, c: Choice, tokens: list[int], first: bool) -> dict:
        if not self.token_ids:
            return {}
        return {"token_ids": tokens, **({"prompt_token_ids": c.prompt} if first else {})}

    def chunk(self, i: int, c: Choice, ev: Event) -> dict:
        first = i not in self.started
        self.started.add(i)
        if self.kind == "completion":
            body = {"index": i, "text": ev.text, "logprobs": None, "finish_reason": ev.finish}
            return self._head("text_completion") | {"choices": [body | self._ids(c, ev.tokens, first)]}
        delta = ({"role": "assistant"} if first else {}) | ({"content": ev.text} if ev.text or first else {})
        body = {"index": i, "delta": delta, "logprobs": None, "finish_reason": ev.finish}
        return self._head("chat.completion.chunk") | {"choices": [body | self._ids(c, ev.tokens, first)]}

    def usage_chunk(self, choices: Choices) -> dict:
        obj = "text_completion" if self.kind == "completion" else "chat.completion.chunk"
        return self._head(obj) | {"choices": [], "usage": usage(choices)}

    def whole(self, choices: Choices) -> dict:
        out = []
        for i, c in enumerate(choices.items):
            ids = self._ids(c, c.tokens, True)
            if self.kind == "completion":
                out.append({"index": i, "text": c.text, "logprobs": None, "finish_reason": c.finish} | ids)
            else:
                out.append({"index": i, "message": {"role": "assistant", "content": c.text}, "logprobs": None,
                            "finish_reason": c.finish} | ids)
        obj = "text_completion" if self.kind == "completion" else "chat.completion"
        return self._head(obj) | {"choices": out, "usage": usage(choices)}
