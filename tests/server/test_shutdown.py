"""`k3x serve` as a process (k3-mini without a tokenizer: no EOS, so a stream runs to max_tokens): SIGTERM while streams are open drains it (the streams complete, new requests and
/health get 503) and it exits 0; a second signal exits at once."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import httpx


def launch(export) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-m", "k3x", "serve", str(export), "--port", "0", "--max-sequences", "4",
                             "--drain-timeout", "60"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=os.environ | {"K3X_API_KEY": "k"})
    line = proc.stdout.readline()
    assert "http://" in line, line + proc.stderr.read()
    return proc, line.split("http://")[1].split()[0]


def stream(url: str, out: list) -> None:
    body = {"model": "k3-mini", "prompt": [1, 2, 3], "max_tokens": 500, "temperature": 0, "stream": True}
    try:
        with httpx.stream("POST", f"http://{url}/v1/completions", json=body, timeout=120,
                          headers={"Authorization": "Bearer k"}) as r:
            out.extend(line for line in r.iter_lines() if line)
    except httpx.HTTPError as e:
        out.append(f"cut: {e}")


def test_sigterm_drains_open_streams_refuses_new_requests_and_exits_0(serving_export):
    proc, url = launch(serving_export)
    try:
        outs = [[] for _ in range(3)]
        threads = [threading.Thread(target=stream, args=(url, o)) for o in outs]
        for t in threads:
            t.start()
        while not all(outs):  # every stream has its first chunk
            time.sleep(0.01)
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.05)
        r = httpx.post(f"http://{url}/v1/completions", json={"model": "k3-mini", "prompt": [1], "max_tokens": 1},
                       headers={"Authorization": "Bearer k"})
        assert r.status_code == 503 and r.json()["error"]["code"] == "shutting_down"
        assert httpx.get(f"http://{url}/health").status_code == 503
        for t in threads:
            t.join(120)
        assert all(o[-1] == "data: [DONE]" and '"finish_reason":"length"' in o[-2] for o in outs), outs
        assert proc.wait(60) == 0, proc.stderr.read()
    finally:
        proc.kill()


def test_a_second_signal_exits_at_once(serving_export):
    proc, url = launch(serving_export)
    try:
        out: list = []
        t = threading.Thread(target=stream, args=(url, out), daemon=True)
        t.start()
        while not out:
            time.sleep(0.01)
        proc.send_signal(signal.SIGINT)
        time.sleep(0.2)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(10) == 1 and "second signal" in proc.stderr.read()
    finally:
        proc.kill()
