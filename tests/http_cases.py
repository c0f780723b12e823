"""Shared by the server tests: a k3x server over an export, in this process (uvicorn on a thread, 127.0.0.1,
an ephemeral port), and what its /metrics says."""

from __future__ import annotations

import re
import time
from pathlib import Path

import httpx


def start(export: Path, backend: str = "ort", *, max_sequences: int = 8, cache_blocks: int | None = None,
          sampler=None, runner=None, speculation=None, **http):
    from k3x.runtime.serve import ServeOptions
    from k3x.server.run import HttpOptions, open_service, serve_in_thread

    options = ServeOptions(max_sequences=max_sequences, cache_blocks=cache_blocks, max_step_tokens=256)
    return serve_in_thread(open_service(export, backend, options, HttpOptions(**http), sampler=sampler,
                                        runner=runner, speculation=speculation))


def metrics(url: str, **headers) -> dict[str, float]:
    """The unlabelled samples of /metrics by name."""
    text = httpx.get(url + "/metrics", headers=headers).text
    return {m[1]: float(m[2]) for m in re.finditer(r"^([a-z0-9_]+) ([0-9.e+-]+)$", text, re.M)}


def settled(url: str, timeout: float = 20) -> dict[str, float]:
    """/metrics once no request runs or waits and no sequence holds a slot or a block."""
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(url)
        busy = [k for k in ("k3x_requests_running", "k3x_requests_waiting", "k3x_kda_slots_in_use",
                            "k3x_mla_blocks_in_use") if m[k]]
        if not busy:
            return m
        assert time.monotonic() < deadline, f"still in use after {timeout} s: {busy}"
        time.sleep(0.05)
