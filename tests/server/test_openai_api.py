"""`k3x serve` driven by the official `openai` SDK: completions and chat completions, streamed and not; greedy
tokens of 12 concurrent prompts of 1 to 2,000 tokens equal to offline serving's (`k3x run --prompts`:
runtime/session.serve_prompts) on ONNX Runtime (pt2: 1 to 125 tokens); the stream's wire format; models, health, metrics."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest
from http_cases import settled, start
from serving_cases import prompts

from k3x.model import preset
from k3x.runtime.serve import ServeOptions
from k3x.runtime.session import open_serving, serve_prompts
from k3x.text.sampling import SamplingOptions
from k3x.text.tokenizer import find_tokenizer

LENGTHS = [1, 2, 7, 33, 64, 129, 250, 500, 900, 1300, 1700, 2000]
NEW = [8, 3, 12, 5, 8, 1, 16, 6, 9, 4, 7, 10]
# pt2's steps are ~10x slower on the CPU than ORT's: its prompts are 1 to 125 tokens, at most 4 new
SCALE = {"ort": (1, 16), "pt2": (16, 4)}


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)


@pytest.mark.parametrize("backend", ["pt2", "ort"])
def test_concurrent_greedy_requests_give_the_tokens_of_run_prompts(serving_export, backend):
    scale, most = SCALE[backend]
    ps = prompts([max(1, n // scale) for n in LENGTHS], preset("k3-mini").vocab_size, seed=7)
    news = [min(n, most) for n in NEW]
    s = open_serving(serving_export, backend)
    offline = serve_prompts(s, backend, ps, SamplingOptions(), ServeOptions(max_sequences=8, block_size=8,
                                                                             max_step_tokens=256),
                            max_new_tokens=news)
    running = start(serving_export, backend, runner=s.runners[backend])  # loaded once (pt2: ~9 s)
    try:
        sdk = openai.AsyncOpenAI(base_url=running.url + "/v1", api_key="unused", max_retries=0)

        async def one(p, n):
            r = await sdk.completions.create(model="k3-mini", prompt=p, max_tokens=n, temperature=0,
                                             extra_body={"return_token_ids": True})
            return r.choices[0].model_extra["token_ids"], r.usage

        async def every():
            return await asyncio.gather(*(one(p, n) for p, n in zip(ps, news)))

        got = asyncio.run(every())
        assert [g[0] for g in got] == [r.tokens for r in offline]
        assert [(u.prompt_tokens, u.completion_tokens) for _, u in got] == [(len(p), len(r.tokens))
                                                                             for p, r in zip(ps, offline)]
        settled(running.url)
    finally:
        running.stop()


def test_completions_text_streamed_and_not(server, chat_export):
    tok = find_tokenizer(chat_export, None)
    sdk = client(server.url)
    whole = sdk.completions.create(model="k3-mini", prompt="The model reads a prompt", max_tokens=12,
                                   temperature=0, extra_body={"return_token_ids": True})
    c = whole.choices[0]
    assert whole.object == "text_completion" and c.finish_reason in ("length", "stop")
    ids = c.model_extra["token_ids"]
    assert c.model_extra["prompt_token_ids"] == tok.encode("The model reads a prompt")
    assert c.text == tok.decode(ids, skip_special=True) and whole.usage.completion_tokens == len(ids)
    chunks = list(sdk.completions.create(model="k3-mini", prompt="The model reads a prompt", max_tokens=12,
                                         temperature=0, stream=True, stream_options={"include_usage": True}))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == c.text
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == c.finish_reason
    assert chunks[-1].usage.completion_tokens == len(ids) and len({ch.id for ch in chunks}) == 1


def test_chat_completions_streamed_and_not(server, chat_export):
    tok = find_tokenizer(chat_export, None)
    sdk = client(server.url)
    messages = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Hello!"}]
    whole = sdk.chat.completions.create(model="k3-mini", messages=messages, max_tokens=10, temperature=0,
                                        extra_body={"return_token_ids": True})
    c = whole.choices[0]
    assert whole.object == "chat.completion" and c.message.role == "assistant"
    assert c.model_extra["prompt_token_ids"] == tok.encode(tok.chat_messages(messages))
    assert c.message.content == tok.decode(c.model_extra["token_ids"], skip_special=True)
    chunks = list(sdk.chat.completions.create(model="k3-mini", messages=messages, max_tokens=10, temperature=0,
                                              stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == c.message.content
    assert chunks[-1].choices[0].finish_reason == c.finish_reason


def test_seeded_sampling_repeats_and_the_stream_ends_with_done(server):
    sdk = client(server.url)
    ask = dict(model="k3-mini", prompt=[5, 6, 7, 8], max_tokens=12, temperature=0.9, top_p=0.95, seed=11,
               extra_body={"top_k": 40, "return_token_ids": True})
    a, b = (sdk.completions.create(**ask).choices[0].model_extra["token_ids"] for _ in range(2))
    assert a == b
    body = {"model": "k3-mini", "prompt": [5, 6, 7], "max_tokens": 3, "temperature": 0, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body) as r:
        events = [line for line in r.iter_lines() if line]
    assert r.headers["content-type"].startswith("text/event-stream")
    assert events[-1] == "data: [DONE]" and all(e.startswith("data: ") for e in events)
    assert json.loads(events[-2][6:])["choices"][0]["finish_reason"] == "length"


def test_models_health_and_metrics(server):
    assert [m.id for m in client(server.url).models.list().data] == ["k3-mini"]
    assert httpx.get(server.url + "/health").status_code == 200
    m = settled(server.url)
    assert m["k3x_generation_tokens_total"] > 0 and m["k3x_time_to_first_token_seconds_count"] > 0
    assert {"k3x_prefix_cache_hits_total", "k3x_spec_decode_accepted_tokens_total",
            "k3x_inter_token_latency_seconds_count", "k3x_e2e_request_latency_seconds_count"} <= set(m)


def test_a_speculating_server_gives_the_same_greedy_tokens_and_refuses_sampling(server, chat_export):
    from http_cases import metrics

    from k3x.runtime.serve_prompts import Speculation

    running = start(chat_export, speculation=Speculation("ngram:3", None, 4))
    try:
        ask = dict(model="k3-mini", prompt=[7, 8, 9, 7, 8, 9, 7, 8], max_tokens=24, temperature=0,
                   extra_body={"return_token_ids": True})
        plain, fast = (client(url).completions.create(**ask).choices[0].model_extra["token_ids"]
                       for url in (server.url, running.url))
        assert fast == plain and metrics(running.url)["k3x_spec_decode_draft_tokens_total"] > 0
        r = httpx.post(running.url + "/v1/completions", json={"model": "k3-mini", "prompt": [1], "temperature": 0.7})
        assert r.status_code == 400 and r.json()["error"]["param"] == "temperature"
    finally:
        running.stop()
