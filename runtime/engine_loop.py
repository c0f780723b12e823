"""The engine loop of `k3x serve`: one thread owns the runner and its state (runtime/engine.py) and admits
requests as they arrive; the HTTP side only submits, cancels and reads events.

    loop = EngineLoop(engine, tokenizer, max_queue=64); loop.start()
    rid = loop.submit(Job(prompt, 16, SamplingOptions(), stop=("\\n",)), sink)   # sink(Event) per step
    loop.cancel(rid)                                                            # a client gone

Threads and queues:
- `submit` / `cancel` put a command on one thread-safe inbox (queue.SimpleQueue); the engine thread drains it
  between steps (blocking on it while idle), so admissions and cancellations take effect at a step boundary
  and nothing outside the thread touches the scheduler, the pools or a runner.
- Each request's `sink(Event)` is called on the engine thread with the tokens of each step (the server wraps
  it with `loop.call_soon_threadsafe` into the request's own asyncio queue); the last event has `finish`.
- Text and stop strings are handled here (an incremental detokenizer per request): a stop string ends the
  request in the step that completed it, and its slot, blocks and cache references are freed before the next
  step. The text a stream may still cut (a stop string's prefix at its end) is held back until it is safe.
- Failures: a request whose sampler, detokenizer or sink raises fails alone (an `error` event; it is
  cancelled); a step that raises (the runner) fails the requests it held; the loop keeps serving either way.
- Timing (the first event of each request): `queued`, submit to the start of the step that admitted it, and
  `prefill`, from that start to the end of the step that gave its first token (a chunked prompt's steps and
  the runner's work included): the scheduler's own prefill time, which the server's TTFT is measured against.
- `max_queue`: requests submitted and not yet admitted; past it `submit` raises QueueFull (the server's 503).
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass
from typing import Callable

from ..text.sampling import Sampler, SamplingOptions
from .base import torch_threads_for
from .engine import Emitted, Engine
from .scheduler import Request


class QueueFull(RuntimeError):
    """More requests wait than `max_queue` allows (retry later)."""


class Closed(RuntimeError):
    """The loop no longer admits requests (draining or stopped)."""


@dataclass(frozen=True)
class Job:
    prompt: tuple[int, ...]
    max_tokens: int
    sampling: SamplingOptions
    stop: tuple[str, ...] = ()


@dataclass
class Event:
    tokens: list[int]  # new token ids
    text: str  # new text ("" without a tokenizer)
    t: float  # time.perf_counter() when the step gave them
    finish: str | None = None  # "stop" (EOS or a stop string), "length" (max_tokens), "error"
    error: str | None = None
    cached: int = 0  # prompt tokens taken from the prefix cache (set on the first event)
    queued: float | None = None  # seconds from submit to the step that admitted it (first event)
    prefill: float | None = None  # seconds from the start of that step to the end of this one (first event)


@dataclass
class _Live:
    job: Job
    sink: Callable[[Event], None]
    stream: object | None  # text/tokenizer.TextStream
    submitted: float  # time.perf_counter() at submit
    admitted: float | None = None  # the start of the step that admitted it
    waiting: bool = True
    text: str = ""
    sent: int = 0  # characters of `text` handed on
    first: bool = True


class EngineLoop:
    idle_wait = 0.05  # seconds an idle loop waits on the inbox before looking at `stop` again

    def __init__(self, engine: Engine, tokenizer=None, *, max_queue: int = 256,
                 sampler: Callable[[SamplingOptions], Callable] = Sampler) -> None:
        self.engine, self.tokenizer, self.max_queue, self.make_sampler = engine, tokenizer, max_queue, sampler
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.live: dict[int, _Live] = {}  # engine thread only
        self._lock = threading.Lock()
        self._next_id = 0
        self._waiting = 0  # submitted, not yet admitted (or dropped)
        self._in_flight = 0  # submitted, final event not yet sent
        self._closed = False
        self._halt = threading.Event()
        self._thread = threading.Thread(target=self._run, name="k3x-engine", daemon=True)
        self.stats: dict[str, int] = {"running": 0, "waiting": 0, **engine.in_use(), **engine.counts}

    # -- any thread --
    def start(self) -> None:
        self._thread.start()

    def submit(self, job: Job, sink: Callable[[Event], None]) -> int:
        """Queue `job` -> its id; QueueFull past `max_queue` waiting, Closed once draining."""
        with self._lock:
            if self._closed:
                raise Closed("the server is shutting down")
            if self._waiting >= self.max_queue:
                raise QueueFull(f"{self._waiting} requests are waiting (--max-queue {self.max_queue})")
            rid, self._next_id = self._next_id, self._next_id + 1
            self._waiting += 1
            self._in_flight += 1
        self.inbox.put(("add", rid, job, sink, time.perf_counter()))
        return rid

    def cancel(self, rid: int) -> None:
        self.inbox.put(("cancel", rid))

    def close(self) -> None:
        """Stop admitting (Closed from now on); requests in flight go on. No lock: a signal handler calls this
        on the thread that may hold it in `submit`."""
        self._closed = True

    @property
    def in_flight(self) -> int:
        with self._lock:
            return self._in_flight

    def stop(self, timeout: float = 10.0) -> None:
        self._halt.set()
        self.inbox.put(("wake",))
        self._thread.join(timeout)

    # -- the engine thread --
    def _run(self) -> None:
        with torch_threads_for(self.engine.runner, getattr(self.engine.drafter, "runner", None)):
            while not self._halt.is_set():
                self._turn()

    def _turn(self) -> None:
        """One pass: the inbox drained (waiting while idle), then a step unless idle."""
        self._drain(block=self.engine.idle)
        if not self.engine.idle:
            self._step()

    def _step(self) -> None:
        began = time.perf_counter()
        try:
            emitted = self.engine.step()
        except Exception as e:  # noqa: BLE001 - the step's requests fail, the loop goes on
            emitted = self._step_failed(e)
        now = time.perf_counter()
        self._admitted(began)
        for em in emitted:
            self._deliver(em, now)
        self._snapshot()

    def _step_failed(self, e: Exception) -> list[Emitted]:
        """A step raised: the requests it held fail (an `error` event each) -> nothing emitted."""
        for rid in self.engine.fail_step():
            self._end(rid, Event([], "", time.perf_counter(), "error", f"{type(e).__name__}: {e}"))
        return []

    def _drain(self, block: bool) -> None:
        try:
            cmd = self.inbox.get(timeout=self.idle_wait) if block else self.inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            self._apply(cmd)
            try:
                cmd = self.inbox.get_nowait()
            except queue.Empty:
                break
        self._snapshot()

    def _apply(self, cmd: tuple) -> None:
        if cmd[0] == "add":
            _, rid, job, sink, submitted = cmd
            live = _Live(job, sink, self.tokenizer.stream() if self.tokenizer is not None else None, submitted)
            self.live[rid] = live
            try:
                self.engine.add(Request(rid, job.prompt, job.max_tokens), self.make_sampler(job.sampling))
            except Exception as e:  # noqa: BLE001 - refused by the engine: this request only
                self._end(rid, Event([], "", time.perf_counter(), "error", str(e)))
        elif cmd[0] == "cancel" and cmd[1] in self.live:
            self.engine.cancel(cmd[1])
            self._forget(cmd[1])

    def _admitted(self, began: float) -> None:
        for rid in self.engine.admitted:
            live = self.live.get(rid)
            if live is not None and live.waiting:
                live.waiting, live.admitted = False, began
                with self._lock:
                    self._waiting -= 1

    def _deliver(self, em: Emitted, now: float) -> None:
        live = self.live.get(em.rid)
        if live is None:
            return
        try:
            if em.error is not None:
                raise RuntimeError(em.error)
            event = Event(list(em.tokens), "", now)
            if live.first:  # admitted by this step or an earlier one
                event.cached = self.engine.cached.get(em.rid, 0)
                event.queued, event.prefill = live.admitted - live.submitted, now - live.admitted
            live.first = False
            for tok in em.tokens:
                live.text += live.stream.push(tok) if live.stream is not None else ""
            if em.done:
                live.text += live.stream.flush() if live.stream is not None else ""
                event.finish = "stop" if em.tokens and em.tokens[-1] in self.engine.sched.eos else "length"
            hit = self._stop_at(live)
            if hit is not None:
                live.text, event.finish = live.text[:hit], "stop"
            event.text = self._take_text(live, event.finish is not None)
            if event.finish is None:
                live.sink(event)
                return
            if not em.done:
                self.engine.cancel(em.rid)  # a stop string: free its slot and blocks now
            self._end(em.rid, event)
        except Exception as e:  # noqa: BLE001 - this request fails, the others go on
            self.engine.cancel(em.rid)
            self._end(em.rid, Event([], "", now, "error", f"{type(e).__name__}: {e}" if em.error is None else em.error))

    def _stop_at(self, live: _Live) -> int | None:
        """Where the first stop string starts in the request's text (searched from what may hold one)."""
        if not live.job.stop:
            return None
        start = max(0, live.sent - max(len(s) for s in live.job.stop))
        hits = [i for i in (live.text.find(s, start) for s in live.job.stop) if i >= 0]
        return min(hits) if hits else None

    def _take_text(self, live: _Live, final: bool) -> str:
        """The text safe to hand on: all of it at the end, else all but what may begin a stop string."""
        keep = 0 if final or not live.job.stop else max(len(s) for s in live.job.stop) - 1
        upto = max(live.sent, len(live.text) - keep)
        out, live.sent = live.text[live.sent: upto], upto
        return out

    def _end(self, rid: int, event: Event) -> None:
        live = self.live.get(rid)
        self.engine.retire(rid)
        self._forget(rid)
        if live is not None:
            try:
                live.sink(event)
            except Exception:  # noqa: BLE001, S110 - the client is gone; nothing is left to tell
                pass

    def _forget(self, rid: int) -> None:
        live = self.live.pop(rid, None)
        if live is None:
            return
        self.engine.retire(rid)
        with self._lock:
            self._in_flight -= 1
            self._waiting -= 1 if live.waiting else 0

    def _snapshot(self) -> None:
        """The figures /metrics reads (one dict, replaced whole: readers never see half an update)."""
        e = self.engine
        self.stats = {"running": len(e.sched.running), "waiting": self._waiting, **e.in_use(), **e.counts}
