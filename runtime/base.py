"""What every runner shares, below the runners themselves: the feed dict, the runner protocol, the one
error type and the options a runner is built with (runtime/runners.py builds them; ort_runner.py,
engine_runner.py and cuda_graph.py implement or wrap them)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from torch import Tensor

Feeds = dict[str, Tensor]


class RunnerError(RuntimeError):
    """A runner cannot be built or run; the message names the file, tensor or provider."""


class Runner(Protocol):
    name: str

    def infer(self, feeds: Feeds) -> Feeds: ...


@dataclass(frozen=True)
class RunnerOptions:
    provider: str = "auto"  # ONNX Runtime: auto | cuda | cpu
    checkpoint: Path | None = None  # eager: overrides the checkpoint recorded in the export
    intra_op_threads: int = 0  # ONNX Runtime: 0 = its default
    profile: str | None = None  # ONNX Runtime: file prefix of its per-node profile (session.end_profiling())
    check_hashes: bool = True  # False: skip the sha256 of artifact files (sizes and paths still checked)
    device: str = "cpu"  # eager, pt2: the device the module runs on (cpu | cuda)
    cuda_graph: bool = False  # decode steps replayed as CUDA graphs (cuda_graph.py); refused where impossible
