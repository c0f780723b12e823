"""`k3x serve` on rank programs (`torchrun --nproc-per-node N -m k3x serve RANKS_EXPORT`): rank 0's engine loop
takes the requests (HTTP lives there alone); every rank runs the same engine over its own rank program and pools.

    peers = Peers()                                   # every rank, after the process group is up
    loop = RankEngineLoop(engine, tokenizer, peers)   # rank 0: the server's loop
    follow(engine, peers)                             # ranks 1..N-1: until rank 0 stops

- Every step boundary of rank 0 is broadcast (`broadcast_object_list` on a gloo group of its own, so it also
  runs beside NCCL): the admissions and cancellations rank 0's engine made since the last one, in order (its
  `Engine.journal`: requests that arrived, clients gone, stop strings, failed samplers), whether rank 0 steps
  now, and its pool counters. The other ranks apply the same adds and cancels to their engines, check their
  counters against rank 0's (a rank that left rank 0's schedule is an error, not wrong tokens) and make the
  same step; the step's tokens are rank 0's (dist_run.agree_tokens), so every scheduler stays identical. Their
  samplers are greedy: what they pick is replaced by rank 0's token and can never fail.
- Idle: rank 0 waits on its inbox at most `HEARTBEAT_S`, then broadcasts an empty boundary, so the other
  ranks sleep in the broadcast (no spinning) and the process group's bounded timeout
  (dist_run.TIMEOUT_S) still catches a rank that is gone.
- Stopping: after rank 0's drain its loop broadcasts `stop` and every rank returns (exit 0). The other ranks
  ignore SIGTERM / SIGINT (a launcher or a terminal sends them to every rank): rank 0 drains and tells them.
- Failures: a step, broadcast or check that raises on any rank ends that rank with one line (rank 0: from
  its engine thread, `os._exit(1)`: its peers may be mid-collective, no request can be served alone); its
  peers' next collective fails or times out, and they end with one line too. The launcher sees the failure.
"""

from __future__ import annotations

import datetime
import os
import signal
import sys
from dataclasses import dataclass, field

import torch.distributed as dist

from ..console import one_line, printable
from ..text.sampling import Sampler, SamplingOptions
from .base import RunnerError, torch_threads_for
from .dist_run import TIMEOUT_S
from .engine import Emitted, Engine
from .engine_loop import EngineLoop

HEARTBEAT_S = 1.0  # an idle rank 0 broadcasts at least this often


@dataclass(frozen=True)
class Boundary:
    """What rank 0 did at one step boundary, for the other ranks to do alike."""
    ops: list[tuple] = field(default_factory=list)  # Engine.journal entries, in order
    step: bool = False  # rank 0 steps after the ops
    in_use: dict[str, int] | None = None  # rank 0's Engine.in_use() after the ops
    stop: bool = False  # rank 0 is done; every rank returns


class Peers:
    """The step boundaries' channel: a gloo group over every rank, rank 0 the source."""

    def __init__(self) -> None:
        self.group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=TIMEOUT_S))

    def send(self, boundary: Boundary) -> None:
        dist.broadcast_object_list([boundary], src=0, group=self.group)

    def receive(self) -> Boundary:
        box: list = [None]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]


class RankEngineLoop(EngineLoop):
    """Rank 0's engine loop: each boundary broadcast before its step; any failure ends the process."""

    idle_wait = HEARTBEAT_S

    def __init__(self, engine: Engine, tokenizer, peers: Peers, **kwargs) -> None:
        super().__init__(engine, tokenizer, **kwargs)
        self.peers = peers
        engine.journal = []

    def _run(self) -> None:
        try:
            super()._run()
            self.peers.send(Boundary(stop=True))
        except Exception as e:  # noqa: BLE001 - the ranks cannot go on apart: one line, the process ends
            print(f"error: rank 0: {printable(one_line(e))}", file=sys.stderr, flush=True)
            os._exit(1)

    def _turn(self) -> None:
        self._drain(block=self.engine.idle)
        ops, self.engine.journal = self.engine.journal, []
        busy = not self.engine.idle
        self.peers.send(Boundary(ops, busy, self.engine.in_use()))
        if busy:
            self._step()

    def _step_failed(self, e: Exception) -> list[Emitted]:
        raise e  # the other ranks are inside the same step's collectives: no request fails alone


def follow(engine: Engine, peers: Peers) -> None:
    """Ranks 1..N-1: rank 0's boundaries applied and stepped until its `stop`. RunnerError when this rank's
    engine is found out of step with rank 0's."""
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)  # rank 0 drains and stops every rank
    greedy = SamplingOptions()
    with torch_threads_for(engine.runner, getattr(engine.drafter, "runner", None)):
        while not (b := peers.receive()).stop:
            for op in b.ops:
                if op[0] == "add":
                    engine.add(op[1], Sampler(greedy))
                else:
                    engine.cancel(op[1])
            mine = engine.in_use()
            if b.step == engine.idle or mine != b.in_use:
                raise RunnerError(f"out of step with rank 0 (pools {mine}, rank 0's {b.in_use}; "
                                  f"{'idle' if engine.idle else 'busy'}, rank 0 {'steps' if b.step else 'idle'})")
            for e in engine.step() if b.step else ():
                if e.done:
                    engine.retire(e.rid)
