"""`k3x serve EXPORT` as one call: open the serving export, start the engine loop, serve HTTP until a signal.

    service = open_service(export_dir, "ort", ServeOptions(max_sequences=8), HttpOptions())
    serve_forever(service, HttpOptions(port=8000))      # the command: SIGTERM / SIGINT drain it
    running = serve_in_thread(service)                  # tests and bench/: uvicorn in a thread, ephemeral port

- Rank programs (a `--serving --tp/--ep` export): inside a launcher (`torchrun --nproc-per-node N -m k3x
  serve`) every rank opens its own step and engine; rank 0 serves HTTP and its engine loop broadcasts each step
  boundary's admissions and cancellations, the others follow it (runtime/engine_ranks.py). Without a launcher
  the ranks are started here as `k3x run` starts them (dist_run.spawn). `open_service` is one program's.
- The MLA cache: `--cache-blocks`, by default enough for every slot at `DEFAULT_POSITIONS` (or the context,
  if shorter) positions; a request that could never fit is refused with 400 rather than queued forever.
- Signals: the first SIGTERM / SIGINT stops admitting (503, /health 503) and lets the requests in flight
  finish, at most `drain_timeout` seconds; uvicorn then closes and the command returns (exit 0). A second
  signal exits at once (exit 1).
- The socket is bound here (127.0.0.1 unless `--host`), so port 0 works and the line printed names the port.
"""

from __future__ import annotations

import os
import socket
import sys
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path

import uvicorn

from ..runtime.engine import Engine, EngineSizes, blocks_for_context
from ..runtime.engine_loop import EngineLoop
from .app import Service, make_app
from .requests import Limits

DEFAULT_POSITIONS = 8192  # per slot, for the default --cache-blocks


@dataclass(frozen=True)
class HttpOptions:
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    model_name: str | None = None  # default: the export folder's name
    max_queue: int = 256
    drain_timeout: float = 30.0
    max_body: int = 4 << 20  # bytes


def open_service(export_dir: Path, backend: str, options, http: HttpOptions, runner_options=None,
                 speculation=None, sampler=None, runner=None) -> Service:
    """The engine loop (started) over the export's serving step and the routes' view of it. `options`:
    runtime/serve.ServeOptions; `speculation`: runtime/serve_prompts.Speculation; `sampler`: the sampler
    factory (tests put a failing one in); `runner`: the export's serving runner when already open."""
    from ..runtime.runners import RunnerError, RunnerOptions, open_folder

    folder = open_folder(export_dir)
    if "parallel" in folder.manifest:
        raise RunnerError(f"{folder.path}: a rank export; `k3x serve` starts its ranks (or run it under "
                          "torchrun --nproc-per-node N -m k3x serve)")
    built = _Engine(folder, backend, options, runner_options or RunnerOptions(), speculation, runner)
    loop = EngineLoop(built.engine, built.tokenizer, max_queue=http.max_queue,
                      **({"sampler": sampler} if sampler else {}))
    loop.start()
    return built.service(loop, http)


class _Engine:
    """The engine over a serving export's step: one program's runner (`runner`, or loaded here), or with
    `ranks` this rank's (inside a launcher: the process group joined, `session` its runtime/session.Session).
    The flags are checked against the traced maxima before anything loads."""

    def __init__(self, folder, backend: str, options, runner_options, speculation, runner=None,
                 ranks: bool = False) -> None:
        from ..runtime.runners import RunnerError, serving_entry
        from ..runtime.serve import serving_runner
        from ..runtime.serve_bounds import check_serving, traced_max
        from ..runtime.serve_prompts import make_drafter
        from ..text.tokenizer import eos_token_ids, find_tokenizer

        entry = serving_entry(folder)
        cfg, block = folder.config(), int(entry["block_size"])
        check_serving(entry, cfg, options, [], 0 if speculation is None else speculation.draft_tokens())
        context = cfg.max_position_embeddings
        blocks = options.cache_blocks or blocks_for_context(options.max_sequences, min(context, DEFAULT_POSITIONS),
                                                            block)
        if blocks > traced_max(entry, "blocks"):
            raise RunnerError(f"--max-sequences {options.max_sequences}: its default cache of {blocks} blocks is "
                              f"over this export's maximum of {traced_max(entry, 'blocks')}; give --cache-blocks")
        self.session, pool_cfg, agree = None, None, None
        if ranks:
            from ..runtime.dist_run import agree_tokens
            from ..runtime.session import open_serving

            self.session = open_serving(folder, backend, runner_options)
            runner, pool_cfg, agree = self.session.runners[backend], self.session.pool_cfg, agree_tokens
        runner = runner or serving_runner(backend, folder, runner_options)
        drafter = None if speculation is None else make_drafter(speculation, backend, runner_options, cfg.vocab_size)
        listed = folder.tokenizer_files()
        self.tokenizer = find_tokenizer(folder.path, listed)
        self.eos = tuple(self.tokenizer.eos_token_ids if self.tokenizer is not None
                         else eos_token_ids(folder.path, listed=listed))
        sizes = EngineSizes(options.max_sequences, blocks, block, options.max_step_tokens,
                            options.prefix_cache_bytes if options.prefix_cache else None)
        self.engine = Engine(runner, cfg, sizes, eos_token_ids=self.eos, dtype=folder.dtype(), drafter=drafter,
                             pool_cfg=pool_cfg, agree=agree)
        self.limits = Limits(context, blocks * block, cfg.vocab_size, 0, drafter is not None)
        self.name = folder.path.name

    def service(self, loop, http: HttpOptions) -> Service:
        limits = replace(self.limits, max_body=http.max_body)
        return Service(loop, self.tokenizer, http.model_name or self.name, limits, self.eos, http.api_key)


def serve_ranks(export_dir: Path, backend: str, options, http: HttpOptions, runner_options, speculation) -> None:
    """Inside a launcher: this rank's engine over its rank program; rank 0 serves HTTP until drained (then
    tells the others to stop), ranks 1..N-1 follow its steps (runtime/engine_ranks.py)."""
    from ..runtime.engine_ranks import Peers, RankEngineLoop, follow
    from ..runtime.runners import RunnerError, open_folder

    built = _Engine(open_folder(export_dir), backend, options, runner_options, speculation, ranks=True)
    s = built.session
    try:
        peers = Peers()
        if s.rank != 0:
            follow(built.engine, peers)
            return
        loop = RankEngineLoop(built.engine, built.tokenizer, peers, max_queue=http.max_queue)
        loop.start()
        try:
            serve_forever(built.service(loop, http), http)
        except OSError as e:
            raise RunnerError(f"--host {http.host} --port {http.port}: {e.strerror or e}") from None
        finally:
            loop.stop()  # its last boundary stops the other ranks
    finally:
        s.close()


class _Server(uvicorn.Server):
    """uvicorn with k3x's shutdown: drain on the first signal, exit at the second."""

    def __init__(self, config: uvicorn.Config, service: Service, drain_timeout: float) -> None:
        super().__init__(config)
        self.service, self.drain_timeout, self.deadline = service, drain_timeout, None

    def handle_exit(self, sig, frame) -> None:
        if self.deadline is not None:
            print("k3x serve: second signal, exiting now", file=sys.stderr, flush=True)
            os._exit(1)
        self.deadline = time.monotonic() + self.drain_timeout
        self.service.begin_drain()
        print(f"k3x serve: draining {self.service.loop.in_flight} requests (at most {self.drain_timeout:g} s)",
              file=sys.stderr, flush=True)

    async def on_tick(self, counter: int) -> bool:
        if self.deadline is not None and (self.service.loop.in_flight == 0 or time.monotonic() > self.deadline):
            return True
        return await super().on_tick(counter)


def _config(service: Service, drain_timeout: float) -> uvicorn.Config:
    return uvicorn.Config(make_app(service), log_level="warning", access_log=False, lifespan="off",
                          timeout_graceful_shutdown=max(1, int(drain_timeout)), timeout_keep_alive=5)


def _bind(host: str, port: int) -> socket.socket:
    """The listening socket, its protocol named: asyncio turns Nagle's algorithm off (TCP_NODELAY) only on
    connections accepted from a socket whose proto is IPPROTO_TCP (socket.create_server leaves it 0). Without
    it a stream's small chunks wait behind the response headers for the client's delayed ACK (~40 ms on Linux):
    the first tokens reached the client together, ~40 ms after the step that gave them."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        sock.bind((host, port))
        sock.listen(2048)
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


def serve_export(export_dir: Path, backend: str, options, http: HttpOptions, runner_options, speculation) -> None:
    """`k3x serve`: the service over the export, served until drained (a refused flag: one line, exit 1; a rank
    export: its ranks, started here unless a launcher started this process, each failing in one line)."""
    from ..console import fail, one_line
    from ..runtime import session as sessions
    from ..runtime.runners import RunnerError

    world = sessions.parallel_plan(export_dir).world
    if world > 1:
        if sessions.world_to_spawn(export_dir):
            sessions.spawn_world(world, sys.argv[1:], pass_signals=True)
            return
        who = f"rank {os.environ['RANK']}: "
        try:
            serve_ranks(export_dir, backend, options, http, runner_options, speculation)
        except (ValueError, RunnerError) as e:  # a flag, a folder, out of step: the message names it
            fail(f"{who}{e}")
        except Exception as e:  # noqa: BLE001 - its peers gone, a step that raised: one line per rank
            fail(f"{who}{one_line(e)}")
        return
    try:
        service = open_service(export_dir, backend, options, http, runner_options, speculation)
    except ValueError as e:
        fail(str(e))
    try:
        serve_forever(service, http)
    except OSError as e:
        fail(f"--host {http.host} --port {http.port}: {e.strerror or e}")


def serve_forever(service: Service, http: HttpOptions) -> None:
    """Serve until a signal (module docstring); returns once drained."""
    sock = _bind(http.host, http.port)
    server = _Server(_config(service, http.drain_timeout), service, http.drain_timeout)
    host, port = sock.getsockname()[:2]
    print(f"k3x serve: {service.model_name} on http://{host}:{port} (OpenAI API under /v1)", flush=True)
    try:
        server.run(sockets=[sock])
    finally:
        service.loop.stop()


@dataclass
class Running:
    service: Service
    server: uvicorn.Server
    thread: threading.Thread
    url: str

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        self.service.loop.stop()


def serve_in_thread(service: Service, host: str = "127.0.0.1", port: int = 0) -> Running:
    """uvicorn on a thread (no signal handling), listening once this returns."""
    sock = _bind(host, port)
    server = uvicorn.Server(_config(service, 5))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="k3x-http", daemon=True)
    thread.start()
    while not server.started and thread.is_alive():
        time.sleep(0.01)
    return Running(service, server, thread, f"http://{host}:{sock.getsockname()[1]}")
