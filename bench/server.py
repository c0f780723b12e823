"""`k3x serve` under load against offline serving of the same prompts (`k3x run --prompts`), in one run.

Starts `python -m k3x serve EXPORT --port 0` (ORT) as a child process, sends mixed-length token-id prompts
through the OpenAI API (httpx, async, streamed) at each concurrency of --concurrency and, with --rate, as
Poisson arrivals at that many requests/s; then serves the same prompts offline in this process
(runtime/session.serve_prompts, the server stopped first so the two never share the cores). Per load: TTFT,
inter-token latency and end-to-end p50 / p99, output tokens/s, and the ratio to offline tokens/s. Greedy,
fixed max_tokens (the export's EOS ids stop a request early either way; tokens are counted as they come).

TTFT against the scheduler's own figures (server/metrics.py's queue- and prefill-time histograms, scraped from
/metrics): per load, their means over the load (the histograms' sums and counts before and after it) and the
mean rest, TTFT - queue - prefill (HTTP and the hand-offs between threads); at concurrency 1, /metrics is also
scraped before and after each request (one at a time: the sums' change is that request's), giving the medians
of TTFT, prefill and TTFT - prefill per request.

    python -m k3x.bench.server --export DIR [--requests 64] [--concurrency 1,8,32] [--rate 4] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path


def mixed_prompts(n: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.choice([16, 64, 128, 256, 512]))] for _ in range(n)]


async def one(client, url: str, prompt: list[int], new: int, model: str = "bench") -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": new, "temperature": 0, "stream": True,
            "return_token_ids": True}
    t0, times, tokens = time.perf_counter(), [], 0
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                got = len(json.loads(line[6:])["choices"][0].get("token_ids") or [])
                if got:
                    times.append(time.perf_counter())
                    tokens += got
    itl = [(b - a) for a, b in zip(times, times[1:])]
    return {"ttft": times[0] - t0, "itl": itl, "e2e": times[-1] - t0, "tokens": tokens}


SCHEDULER = ("k3x_request_queue_time_seconds", "k3x_request_prefill_time_seconds")


async def scheduler_sums(client, url: str) -> dict[str, float]:
    """The queue- and prefill-time histograms' `_sum` and `_count` from /metrics."""
    text = (await client.get(url + "/metrics")).text
    return {m[1]: float(m[2]) for m in re.finditer(r"^([a-z0-9_]+_(?:sum|count)) ([0-9.e+-]+)$", text, re.M)
            if m[1].rsplit("_", 1)[0] in SCHEDULER}


def change(before: dict[str, float], after: dict[str, float], name: str) -> float:
    return after[name] - before[name]


async def load(url: str, prompts, new: int, concurrency: int | None, rate: float | None,
               model: str = "bench") -> tuple[list[dict], float, dict]:
    import httpx

    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=256)) as client:
        gate = asyncio.Semaphore(concurrency or len(prompts))
        rng = random.Random(1)
        alone = concurrency == 1 and not rate

        async def send(i: int, p) -> dict:
            if rate:
                await asyncio.sleep(arrivals[i])
            async with gate:
                if not alone:
                    return await one(client, url, p, new, model)
                before = await scheduler_sums(client, url)
                got = await one(client, url, p, new, model)
                after = await scheduler_sums(client, url)
                return got | {"prefill": change(before, after, "k3x_request_prefill_time_seconds_sum")}

        arrivals, t = [], 0.0
        for _ in prompts:
            t += rng.expovariate(rate) if rate else 0
            arrivals.append(t)
        start = await scheduler_sums(client, url)
        t0 = time.perf_counter()
        out = await asyncio.gather(*(send(i, p) for i, p in enumerate(prompts)))
        wall = time.perf_counter() - t0
        end = await scheduler_sums(client, url)
        n = change(start, end, "k3x_request_prefill_time_seconds_count")
        means = {f"{k}_mean": change(start, end, f"k3x_request_{k}_time_seconds_sum") / n for k in ("queue", "prefill")}
        return out, wall, means


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] * 1000 if xs else float("nan")


def row(name: str, results: list[dict], wall: float, means: dict, offline_tps: float) -> dict:
    ttft, e2e = [r["ttft"] for r in results], [r["e2e"] for r in results]
    itl = [x for r in results for x in r["itl"]]
    tps = sum(r["tokens"] for r in results) / wall
    ttft_mean = statistics.fmean(ttft)
    out = {"load": name, "ttft_p50_ms": pct(ttft, 0.5), "ttft_p99_ms": pct(ttft, 0.99),
           "itl_p50_ms": pct(itl, 0.5), "itl_p99_ms": pct(itl, 0.99), "e2e_p50_ms": pct(e2e, 0.5),
           "e2e_p99_ms": pct(e2e, 0.99), "tokens_per_s": tps, "vs_offline": tps / offline_tps,
           "ttft_mean_ms": ttft_mean * 1000, "queue_mean_ms": means["queue_mean"] * 1000,
           "prefill_mean_ms": means["prefill_mean"] * 1000,
           "rest_mean_ms": (ttft_mean - means["queue_mean"] - means["prefill_mean"]) * 1000}
    if all("prefill" in r for r in results):
        out |= {"prefill_p50_ms": pct([r["prefill"] for r in results], 0.5),
                "ttft_minus_prefill_p50_ms": pct([r["ttft"] - r["prefill"] for r in results], 0.5)}
    return out


def start_server(export: Path, max_sequences: int) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-m", "k3x", "serve", str(export), "--port", "0", "--max-sequences",
                             str(max_sequences), "--served-model-name", "bench", "--max-queue", "4096"],
                            stdout=subprocess.PIPE, text=True, env=os.environ)
    line = proc.stdout.readline()
    if "http://" not in line:
        raise SystemExit(f"k3x serve did not start: {line!r}")
    return proc, "http://" + line.split("http://")[1].split()[0]


def offline(folder, prompts, new: int, max_sequences: int) -> float:
    """Output tokens/s of the same prompts served offline (`k3x run --prompts`'s path), greedy."""
    from k3x.runtime.runners import serving_entry
    from k3x.runtime.serve import ServeOptions
    from k3x.runtime.session import open_serving, serve_prompts
    from k3x.text.sampling import SamplingOptions

    s = open_serving(folder, "ort")
    options = ServeOptions(max_sequences=max_sequences, block_size=int(serving_entry(folder)["block_size"]))
    t0 = time.perf_counter()
    records = serve_prompts(s, "ort", prompts, SamplingOptions(new), options)
    return sum(len(r.tokens) for r in records) / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--export", type=Path, required=True)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--new", type=int, default=32, help="max_tokens of every request")
    ap.add_argument("--concurrency", default="1,8,32")
    ap.add_argument("--rate", type=float, default=None, help="also Poisson arrivals at this many requests/s")
    ap.add_argument("--max-sequences", type=int, default=32)
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args()
    from k3x.folder.artifacts import ExportFolder

    folder = ExportFolder.open(a.export)
    prompts = mixed_prompts(a.requests, folder.config().vocab_size)
    loads = [(f"concurrency {c}", int(c), None) for c in a.concurrency.split(",")]
    loads += [(f"poisson {a.rate:g}/s", None, a.rate)] if a.rate else []
    proc, url = start_server(a.export, a.max_sequences)
    try:
        measured = [(name, *asyncio.run(load(url, prompts, a.new, c, r))) for name, c, r in loads]
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(120)
    base = offline(folder, prompts, a.new, a.max_sequences)
    rows = [row(name, res, wall, means, base) for name, res, wall, means in measured]
    print(f"offline (run --prompts): {base:.1f} tokens/s over {len(prompts)} prompts")
    print(f"{'load':<16}{'TTFT p50/p99 ms':>18}{'ITL p50/p99 ms':>18}{'e2e p50/p99 ms':>20}{'tok/s':>9}{'vs offline':>12}")
    for r in rows:
        print(f"{r['load']:<16}{r['ttft_p50_ms']:>9.1f}/{r['ttft_p99_ms']:<8.1f}{r['itl_p50_ms']:>9.1f}/"
              f"{r['itl_p99_ms']:<8.1f}{r['e2e_p50_ms']:>10.1f}/{r['e2e_p99_ms']:<9.1f}{r['tokens_per_s']:>9.1f}"
              f"{r['vs_offline']:>11.0%}")
    print(f"\n{'load':<16}{'TTFT p50':>10}{'prefill p50':>13}{'TTFT-prefill p50':>18}"
          f"{'TTFT mean':>11}{'queue mean':>12}{'prefill mean':>14}{'rest mean':>11}   (ms)")
    for r in rows:
        alone = [f"{r[k]:>{w}.1f}" if k in r else f"{'-':>{w}}" for k, w in
                 (("prefill_p50_ms", 13), ("ttft_minus_prefill_p50_ms", 18))]
        print(f"{r['load']:<16}{r['ttft_p50_ms']:>10.1f}{alone[0]}{alone[1]}{r['ttft_mean_ms']:>11.1f}"
              f"{r['queue_mean_ms']:>12.1f}{r['prefill_mean_ms']:>14.1f}{r['rest_mean_ms']:>11.1f}")
    if a.json is not None:
        a.json.write_text(json.dumps({"offline_tokens_per_s": base, "loads": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
