"""`k3x serve` on a TP=2 x EP=2 serving rank export (k3-mini, the "echo" weights of
tests/runtime/test_rank_serving.py, pt2, gloo on CPU), driven by the official `openai` SDK. Under `torchrun
--nproc-per-node 4`: greedy completions, streamed and not, sent together, give the tokens of each prompt's solo
eager run in one process; a client that hangs up mid-stream leaves every pool counter of /metrics at zero and
the ranks still serve in step (each rank checks its pools against rank 0's at every step boundary); a rank
killed ends every other rank with one line, no hang. Without a launcher (`k3x serve RANKS` starts the ranks):
SIGTERM drains rank 0's open stream to its end and every rank exits 0. One export for the module, two launches.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
from dist_launch import env
from http_cases import settled
from serving_cases import prompts, solo

from k3x.bench.speculate import echo_model
from k3x.checkpoint.save import save_checkpoint
from k3x.exporter.options import ExportOptions, Target
from k3x.exporter.pipeline import export
from k3x.model import preset

CFG = preset("k3-mini")
PROMPTS = prompts([1, 5, 20, 37], CFG.vocab_size, seed=5)  # 37 tokens: prefilled in 3 chunks of 16
NEWS = [3, 4, 2, 3]
TIMEOUT_S = 120  # a client's, per request


@pytest.fixture(scope="module")
def model():
    return echo_model("k3-mini", 0.5)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory, model) -> Path:
    root = tmp_path_factory.mktemp("rank-serve")
    save_checkpoint(model, root / "ckpt", expert_format="dense")
    export(ExportOptions((Target.PT2,), root / "ranks", checkpoint=root / "ckpt", tp=2, ep=2, serving=True,
                         block_size=8))
    return root / "ranks"


def start(cmd: list[str], log: Path) -> tuple[subprocess.Popen, str]:
    """`cmd` started in its own session, its standard error to `log` -> (the process, the base URL rank 0
    prints once it listens)."""
    with open(log, "w") as err:
        proc = subprocess.Popen(cmd, env=env(), stdout=subprocess.PIPE, stderr=err, text=True,
                                start_new_session=True)
    line = proc.stdout.readline()
    if "http://" not in line:
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail(line + log.read_text()[-4000:])
    return proc, "http://" + line.split("http://")[1].split()[0]


def serve_args(ranks: Path) -> list[str]:
    return ["serve", str(ranks), "--backend", "pt2", "--port", "0", "--max-sequences", "3", "--cache-blocks", "48",
            "--max-step-tokens", "16"]


def rank_pid(parent: int, rank: int) -> int:
    """The pid of rank `rank` among `parent`'s children (its RANK variable)."""
    children = [int(p) for p in Path(f"/proc/{parent}/task/{parent}/children").read_text().split()]
    return next(p for p in children if f"RANK={rank}" in Path(f"/proc/{p}/environ").read_text().split("\0"))


@pytest.fixture(scope="module")
def served(ranks):
    """The rank export served by 4 torchrun ranks -> (the torchrun process, the base URL, its stderr file)."""
    log = ranks.parent / "torchrun.err"
    proc, url = start([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4", "-m",
                       "k3x", *serve_args(ranks)], log)
    try:
        yield proc, url, log
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)


def sdk(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=TIMEOUT_S)


async def complete(client, prompt: list[int], n: int, stream: bool) -> list[int]:
    ask = dict(model="ranks", prompt=prompt, max_tokens=n, temperature=0, extra_body={"return_token_ids": True})
    if not stream:
        return (await client.completions.create(**ask)).choices[0].model_extra["token_ids"]
    ids = []
    async for chunk in await client.completions.create(**ask, stream=True):
        if chunk.choices:
            ids += chunk.choices[0].model_extra.get("token_ids", [])
    return ids


def test_concurrent_greedy_completions_give_one_process_tokens(served, model):
    _, url, _ = served

    async def every():
        client = sdk(url)
        return await asyncio.gather(*(complete(client, p, n, stream=i % 2 == 1)
                                      for i, (p, n) in enumerate(zip(PROMPTS, NEWS))))

    got = asyncio.run(every())
    assert got == [solo(model, p, n)[0] for p, n in zip(PROMPTS, NEWS)]


def test_a_client_gone_mid_stream_frees_every_pool_and_the_ranks_keep_step(served, model):
    _, url, _ = served

    async def hang_up():
        stream = await sdk(url).completions.create(model="ranks", prompt=PROMPTS[2], max_tokens=200, temperature=0,
                                                   stream=True)
        async for _ in stream:
            break  # the first chunk: the request holds a slot and blocks on every rank
        await stream.close()

    asyncio.run(hang_up())
    m = settled(url)
    assert m["k3x_kda_slots_in_use"] == m["k3x_mla_blocks_in_use"] == m["k3x_prefix_cache_blocks"] == 0, m
    assert asyncio.run(complete(sdk(url), PROMPTS[1], 4, stream=False)) == solo(model, PROMPTS[1], 4)[0]


def test_a_lost_rank_ends_every_rank_with_one_line(served):
    """SIGKILL to rank 2: every other rank ends (rank 0 with one line naming the lost peer) and torchrun
    fails, well within the process group's timeout: no rank hangs."""
    proc, _, log = served
    t = time.monotonic()
    os.kill(rank_pid(proc.pid, 2), signal.SIGKILL)
    assert proc.wait(60) != 0 and time.monotonic() - t < 30
    err = log.read_text()
    # each rank ends at its next collective with rank 2 (one line), or on rank 0's last word if torchrun's
    # SIGTERM to the survivors made rank 0 drain first (then only rank 0's send to rank 2 fails)
    lines = {line[:15] for line in err.splitlines() if line.startswith("error: ")}
    assert "error: rank 0: " in lines and lines <= {"error: rank 0: ", "error: rank 1: ", "error: rank 3: "}, \
        err[-4000:]


@pytest.mark.slow
def test_without_a_launcher_k3x_starts_the_ranks_and_sigterm_drains_them_exit_0(ranks, model):
    """`k3x serve RANKS` spawns its 4 ranks (dist_run.spawn) and serves; SIGTERM to it is passed on: rank 0
    drains (the open stream completes, /health 503), every rank ends, exit 0."""
    log = ranks.parent / "spawned.err"
    proc, url = start([sys.executable, "-m", "k3x", *serve_args(ranks)], log)
    try:
        async def drained() -> list[int]:
            ids, client = [], sdk(url)
            async for chunk in await client.completions.create(model="ranks", prompt=PROMPTS[1], max_tokens=12,
                                                               temperature=0, stream=True,
                                                               extra_body={"return_token_ids": True}):
                if not ids:  # the first chunk: the request runs on every rank
                    proc.send_signal(signal.SIGTERM)
                    await asyncio.sleep(0.3)
                    assert httpx.get(url + "/health").status_code == 503
                ids += chunk.choices[0].model_extra.get("token_ids", []) if chunk.choices else []
            return ids

        assert asyncio.run(drained()) == solo(model, PROMPTS[1], 12)[0]
        assert proc.wait(60) == 0, log.read_text()[-4000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)


@pytest.mark.slow
def test_sigkill_to_k3x_serve_ends_the_ranks_it_started(ranks):
    """SIGKILL to `k3x serve RANKS` (no handler runs, its agent dies with it): every rank it started gets SIGTERM
    (dist_run.follow_spawner), so rank 0 drains and they all end, and the port is free again. Before, the
    ranks went on serving, the process the user ran gone."""
    import psutil

    log = ranks.parent / "killed.err"
    proc, url = start([sys.executable, "-m", "k3x", *serve_args(ranks)], log)
    pids = []
    try:
        pids = [rank_pid(proc.pid, r) for r in range(4)]
        assert httpx.get(url + "/health").status_code == 200
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(30)

        def alive(pid: int) -> bool:
            try:
                return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
            except psutil.NoSuchProcess:
                return False

        deadline = time.monotonic() + 60
        while any(alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not any(alive(p) for p in pids), log.read_text()[-4000:]
        with pytest.raises(httpx.ConnectError):
            httpx.get(url + "/health", timeout=5)
    finally:  # the ranks run in sessions of their own (torch.distributed.run starts them so)
        for kill, pid in [(os.killpg, proc.pid)] + [(os.kill, p) for p in pids]:
            with contextlib.suppress(ProcessLookupError):
                kill(pid, signal.SIGKILL)
