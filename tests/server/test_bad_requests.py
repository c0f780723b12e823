"""Every bad request gets a 4xx with OpenAI's error body naming the field, and the server answers the next
request correctly; the waiting queue's bound (503 + Retry-After), the API key and a cache too small for a
prompt."""

from __future__ import annotations

import asyncio
import threading

import httpx
import pytest
from http_cases import settled, start
from serving_cases import FAILING_SEED, FlakySampler

GOOD = {"model": "k3-mini", "prompt": [1, 2, 3], "max_tokens": 4, "temperature": 0}
CHAT = {"model": "k3-mini", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}

CASES = {  # name: (route, body (bytes: sent as is), status, param)
    "bad json": ("/v1/completions", b'{"model": "k3-mini", "prompt": [1,', 400, None),
    "not an object": ("/v1/completions", b"[1, 2]", 400, None),
    "wrong type": ("/v1/completions", GOOD | {"max_tokens": "ten"}, 400, "max_tokens"),
    "max_tokens 0": ("/v1/completions", GOOD | {"max_tokens": 0}, 400, "max_tokens"),
    "n 2": ("/v1/completions", GOOD | {"n": 2}, 400, "n"),
    "negative temperature": ("/v1/completions", GOOD | {"temperature": -1}, 400, "temperature"),
    "no prompt": ("/v1/completions", {"model": "k3-mini"}, 400, "prompt"),
    "empty prompt": ("/v1/completions", GOOD | {"prompt": []}, 400, "prompt"),
    "token id outside the vocabulary": ("/v1/completions", GOOD | {"prompt": [1, 512]}, 400, "prompt"),
    "prompt longer than the context": ("/v1/completions", GOOD | {"prompt": [1] * 4096}, 400, "prompt"),
    "max_tokens past the context": ("/v1/completions", GOOD | {"prompt": [1] * 4000, "max_tokens": 200}, 400,
                                    "max_tokens"),
    "five stop strings": ("/v1/completions", GOOD | {"stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
    "unknown model": ("/v1/completions", GOOD | {"model": "gpt-4"}, 404, "model"),
    "chat role": ("/v1/chat/completions", CHAT | {"messages": [{"role": "wizard", "content": "x"}]}, 400,
                  "messages.0.role"),
    "chat no messages": ("/v1/chat/completions", CHAT | {"messages": []}, 400, "messages"),
    "body too large": ("/v1/completions", b'{"prompt": "' + b"x" * (5 << 20) + b'"}', 413, None),
    "unknown route": ("/v1/embeddings", GOOD, 404, None),
}


def post(url: str, route: str, body, **kw) -> httpx.Response:
    if isinstance(body, bytes):
        return httpx.post(url + route, content=body, headers={"content-type": "application/json"}, **kw)
    return httpx.post(url + route, json=body, **kw)


@pytest.mark.parametrize("name", CASES)
def test_a_bad_request_is_refused_by_name_and_the_next_is_served(server, name):
    route, body, status, param = CASES[name]
    r = post(server.url, route, body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"] and err["param"] == param
    ok = post(server.url, "/v1/completions", GOOD | {"return_token_ids": True})
    assert ok.status_code == 200 and len(ok.json()["choices"][0]["token_ids"]) == 4


def test_the_api_key_guards_every_route_but_health(chat_export):
    running = start(chat_export, max_sequences=2, api_key="s3cret")
    try:
        for route in ("/v1/models", "/metrics"):
            assert httpx.get(running.url + route).status_code == 401
            assert httpx.get(running.url + route, headers={"Authorization": "Bearer s3cre"}).status_code == 401
        r = post(running.url, "/v1/completions", GOOD)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(running.url + "/health").status_code == 200
        r = post(running.url, "/v1/completions", GOOD, headers={"Authorization": "Bearer s3cret"})
        assert r.status_code == 200
    finally:
        running.stop()


def test_past_max_queue_503_with_retry_after_then_served_and_hang_ups_free_slots(serving_export):
    running = start(serving_export, max_sequences=1, max_queue=1)  # no tokenizer, no EOS: the first runs on
    long = GOOD | {"max_tokens": 3000, "stream": True}
    try:
        async def crowd():
            async with httpx.AsyncClient(timeout=60) as c:
                async with c.stream("POST", running.url + "/v1/completions", json=long) as first:
                    lines = first.aiter_lines()  # kept: a generator dropped closes the response
                    await lines.__anext__()  # the first holds the one slot
                    waiting = asyncio.create_task(c.post(running.url + "/v1/completions", json=GOOD))
                    while "k3x_requests_waiting 1.0" not in (await c.get(running.url + "/metrics")).text:
                        assert not waiting.done(), waiting.result().text
                        await asyncio.sleep(0.01)
                    refused = await c.post(running.url + "/v1/completions", json=GOOD)
                # the first client hung up: its slot goes to the one waiting
                return refused, await waiting

        refused, waited = asyncio.run(crowd())
        assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
        assert refused.json()["error"]["code"] == "queue_full" and waited.status_code == 200
        settled(running.url)
        with pytest.raises(httpx.ReadTimeout):  # a client that gives up on a whole answer frees its slot too
            post(running.url, "/v1/completions", GOOD | {"max_tokens": 3000}, timeout=httpx.Timeout(60, read=0.5))
        settled(running.url, timeout=5)
    finally:
        running.stop()


def test_a_prompt_the_cache_can_never_hold_is_refused(chat_export):
    running = start(chat_export, max_sequences=2, cache_blocks=4)  # 32 positions
    try:
        r = post(running.url, "/v1/completions", GOOD | {"prompt": list(range(40))})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt" and "cache" in r.json()["error"]["message"]
        assert post(running.url, "/v1/completions", GOOD).status_code == 200
    finally:
        running.stop()


def test_an_error_inside_one_request_is_a_500_for_it_alone(chat_export):
    running = start(chat_export, sampler=FlakySampler)
    try:
        results = {}

        def ask(key, body):
            results[key] = post(running.url, "/v1/completions", body, timeout=60)

        bodies = {"bad": GOOD | {"temperature": 1.0, "seed": FAILING_SEED, "max_tokens": 8}, "good": GOOD | {"max_tokens": 8}}
        threads = [threading.Thread(target=ask, args=kv) for kv in bodies.items()]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert results["bad"].status_code == 500 and "boom" in results["bad"].json()["error"]["message"]
        assert results["good"].status_code == 200
        settled(running.url)
    finally:
        running.stop()
