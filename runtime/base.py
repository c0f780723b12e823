"""What every runner shares, below the runners themselves: the feed dict, the runner protocol, the one
error type and the options a runner is built with (runtime/runners.py builds them; ort_runner.py,
engine_runner.py and cuda_graph.py implement or wrap them)."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Protocol

import torch
from torch import Tensor

Feeds = dict[str, Tensor]


class RunnerError(RuntimeError):
    """A runner cannot be built or run; the message names the file, tensor or provider."""


class Runner(Protocol):
    name: str

    def infer(self, feeds: Feeds) -> Feeds: ...


@contextlib.contextmanager
def torch_threads_for(*runners) -> Iterator[None]:
    """torch on one thread while a loop drives `runners` (None entries ignored), when every one of them
    computes outside torch (its `torch_threads = 1`: ONNX Runtime, TensorRT); if any computes in torch (eager,
    pt2, a model drafter on pt2) torch keeps its threads.

    What torch does around such a runner is bookkeeping (feeds, pool rows, sampling), but any of it on more
    than one thread leaves torch's OpenMP workers spinning after it (tens of ms by default), on the cores the
    runner's own threads need. Measured (2-core CPU, k3-bench ORT serving export): one 128-token prefill as a
    serving step, 3 processes each way alternating, 240-253 ms with torch on 2 threads, 219-230 ms on one
    (222-225 ms with OMP_WAIT_POLICY=PASSIVE: the same cause); serve() on 32 short prompts x 64 new tokens, 32
    slots, alternating in one process, 189-197 -> 199-208 tokens/s (a prefill-heavy mix: within its noise)."""
    wanted = [getattr(r, "torch_threads", None) for r in runners if r is not None]
    if not wanted or None in wanted:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(min(wanted))
    try:
        yield
    finally:
        torch.set_num_threads(before)


@dataclass(frozen=True)
class RunnerOptions:
    provider: str = "auto"  # ONNX Runtime: auto | cuda | cpu
    checkpoint: Path | None = None  # eager: overrides the checkpoint recorded in the export
    intra_op_threads: int = 0  # ONNX Runtime: 0 = its default
    profile: str | None = None  # ONNX Runtime: file prefix of its per-node profile (session.end_profiling())
    check_hashes: bool = True  # False: skip the sha256 of artifact files (sizes and paths still checked)
    device: str = "cpu"  # eager, pt2: the device the module runs on (cpu | cuda)
    cuda_graph: bool = False  # decode steps replayed as CUDA graphs (cuda_graph.py); refused where impossible
