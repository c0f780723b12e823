"""The engine loop (runtime/engine_loop.py) over k3-mini's serving step (ORT): requests admitted while others
run give the tokens offline serving gives; a cancelled request, a stop string and a failing sampler free the
sequence's slot, blocks and prefix-cache hit at once; one request's failure leaves the others untouched."""

from __future__ import annotations

import queue
import time

import pytest
from serving_cases import FAILING_SEED, FlakySampler, prompts

from k3x.model import preset
from k3x.runtime.engine import Engine, EngineSizes
from k3x.runtime.engine_loop import EngineLoop, Job
from k3x.runtime.serve import ServeOptions, serve, serving_runner
from k3x.text.sampling import Sampler, SamplingOptions

CFG = preset("k3-mini")
GREEDY = SamplingOptions(8)


@pytest.fixture(scope="module")
def runner(serving_export):
    return serving_runner("ort", serving_export)


class Letters:
    """A tokenizer for the loop's text: token t is the letter chr(97 + t % 26)."""

    def decode(self, ids, skip_special=False):
        return "".join(chr(97 + i % 26) for i in ids)

    def stream(self):
        from k3x.text.tokenizer import TextStream

        return TextStream(self)


def start(runner, *, prefix: bool = False, tokenizer=None, sampler=Sampler, max_queue: int = 64) -> EngineLoop:
    engine = Engine(runner, CFG, EngineSizes(3, 64, 8, 16, 1 << 20 if prefix else None))
    loop = EngineLoop(engine, tokenizer, max_queue=max_queue, sampler=sampler)
    loop.start()
    return loop


def submit(loop: EngineLoop, job: Job) -> tuple[int, queue.Queue]:
    events: queue.Queue = queue.Queue()
    return loop.submit(job, events.put), events


def finish(events: queue.Queue) -> tuple[list[int], str, str | None, str]:
    tokens, text = [], ""
    while True:
        ev = events.get(timeout=60)
        tokens += ev.tokens
        text += ev.text
        if ev.finish is not None:
            return tokens, text, ev.finish, ev.error


def idle(loop: EngineLoop) -> dict:
    deadline = time.monotonic() + 10
    while loop.in_flight or loop.stats["running"]:
        assert time.monotonic() < deadline, loop.stats
        time.sleep(0.01)
    return loop.stats


def test_online_admission_and_cancellation_give_offline_tokens_and_free_everything(runner):
    ps = prompts([5, 17, 3, 30, 9, 12, 2, 26], CFG.vocab_size, seed=3)
    want = [r.tokens for r in serve(runner, CFG, ps, GREEDY, ServeOptions(max_sequences=3, block_size=8,
                                                                          max_step_tokens=16))]
    loop = start(runner, prefix=True)
    try:
        handles = []
        for i, p in enumerate(ps):  # arriving while others run
            handles.append(submit(loop, Job(tuple(p), 8, GREEDY)))
            if i % 3 == 2:
                time.sleep(0.05)
            if i == 4:
                loop.cancel(handles[1][0])  # running or queued by now
        got = {}
        for i, (_, events) in enumerate(handles):
            if i != 1:
                got[i] = finish(events)
        assert all(got[i][0] == want[i] for i in got), {i: (got[i][0], want[i]) for i in got}
        assert all(got[i][2] in ("length", "stop") for i in got)
        stats = idle(loop)
        assert (stats["kda_slots"], stats["mla_blocks"], stats["running"], stats["waiting"]) == (0, 0, 0, 0)
        assert not loop.engine.prefix.hits and not loop.engine.sched.finished and not loop.engine.samplers
    finally:
        loop.stop()


def test_a_stop_string_ends_the_request_and_frees_its_slot_in_that_step(runner):
    loop = start(runner, tokenizer=Letters())
    try:
        p = tuple(prompts([6], CFG.vocab_size, seed=1)[0])
        full, text, _, _ = finish(submit(loop, Job(p, 12, GREEDY))[1])
        assert text == Letters().decode(full)
        stop = text[5:7]  # the first occurrence may be earlier: the text is cut at it
        rid, events = submit(loop, Job(p, 12, GREEDY, stop=(stop,)))
        tokens, cut, reason, _ = finish(events)
        assert reason == "stop" and cut == text[: text.find(stop)] and tokens == full[: len(tokens)]
        assert len(tokens) < 12 and rid not in loop.engine.alloc.slot_of  # freed before the final event
    finally:
        loop.stop()


def test_a_failing_sampler_fails_its_request_only(runner):
    loop = start(runner, sampler=FlakySampler)
    try:
        ps = prompts([4, 7, 11], CFG.vocab_size, seed=5)
        want = [r.tokens for r in serve(runner, CFG, ps, GREEDY, ServeOptions(max_sequences=3, block_size=8))]
        sampled = SamplingOptions(8, temperature=1.0, seed=FAILING_SEED)
        handles = [submit(loop, Job(tuple(p), 8, sampled if i == 1 else GREEDY)) for i, p in enumerate(ps)]
        out = [finish(events) for _, events in handles]
        assert out[1][2] == "error" and "boom" in out[1][3]
        assert [out[0][0], out[2][0]] == [want[0], want[2]]
        stats = idle(loop)
        assert (stats["kda_slots"], stats["mla_blocks"]) == (0, 0)
        assert finish(submit(loop, Job(tuple(ps[0]), 8, GREEDY))[1])[0] == want[0]  # the loop goes on
    finally:
        loop.stop()


def test_the_first_event_carries_the_queue_time_and_the_prefill_over_all_its_steps(runner):
    loop = start(runner)  # 16 tokens a step: a 40-token prompt is prefilled in 3 steps
    steps: list[tuple[float, float]] = []
    step = loop.engine.step

    def timed():
        t = time.perf_counter()
        out = step()
        steps.append((t, time.perf_counter()))
        return out

    loop.engine.step = timed
    try:
        t0 = time.perf_counter()
        _, events = submit(loop, Job(tuple(prompts([40], CFG.vocab_size, seed=2)[0]), 4, GREEDY))
        t1 = time.perf_counter()
        first = events.get(timeout=60)
        rest = [events.get(timeout=60) for _ in range(3)]
        assert first.tokens and first.queued >= 0 and first.prefill > 0
        submitted, admitted = first.t - first.prefill - first.queued, first.t - first.prefill
        assert t0 - 1e-6 <= submitted <= t1 + 1e-6
        assert admitted <= steps[0][0] and first.t >= steps[2][1]  # from the first chunk's step to the third's end
        assert first.prefill >= steps[2][1] - steps[0][0]
        assert all(e.queued is None and e.prefill is None for e in rest) and rest[-1].finish == "length"
    finally:
        loop.stop()
