"""Decode steps replayed as CUDA graphs: a wrapper over a runner on CUDA (eager model, pt2 program, AOTI package
compiled for CUDA, TensorRT engine).

A decode step launches hundreds of small kernels (KDA's recurrent kernel is a few µs at B=1); launched one by
one from Python, host overhead dominates. `GraphedRunner.infer` captures the step once into a CUDA graph with
static buffers — the step's inputs (`input_ids`, every `past.*`, `past_length`) are copied into them in place
and the graph is replayed; its outputs (`logits`, `present.*`) are the graph's own buffers, valid until the
next call (the decode loop turns them into the next step's `past.*`, which are copied in before the replay
overwrites them).

Notable choices:
- A graph is keyed by every feed's shape and dtype and captured on the SECOND step with that key (so a
  prefill, or a shape seen once, never pays a capture). Recurrent state (KDA's [B, H, K, V], the conv
  windows) has one shape for the whole decode. The MLA latent cache grows by one position per step unless the
  export has a static cache (`--max-context`, model/state.py): then every decode step of a hybrid model has
  one key and replays one graph; with the growing cache hybrid steps run eagerly (`stats["eager"]`).
- What is captured: a torch-module runner's `infer` (ModuleRunner: eager, pt2, aoti), or a runner's `enqueue`
  where it has one (TrtRunner: bind the static buffers, `execute_async_v3` on the capture stream, no sync).
  One warm-up step on the capture stream comes first (Triton compiles, TensorRT's deferred setup after a shape
  change, the allocator settles).
- Feeds are moved to the graph's device first (the decode loop hands CPU token ids).
- `require_cuda_graph` refuses, in one line, a runner that cannot be graphed (no CUDA, ONNX Runtime — it has
  its own `enable_cuda_graph` session option —, a module on the CPU, an AOTI package compiled for the CPU).
- At most `max_graphs` graphs are kept (each holds a private memory pool); beyond, steps run eagerly. A
  capture that fails (a step that syncs, or allocates outside the pool) leaves that key eager.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from .base import Feeds, RunnerError


@dataclass
class _Graph:
    graph: object  # torch.cuda.CUDAGraph (or anything with replay())
    inputs: Feeds  # static input buffers, updated in place
    outputs: Feeds  # the graph's outputs


@dataclass
class GraphedRunner:
    """`infer` of `runner` with repeated-shape decode steps replayed from CUDA graphs."""
    runner: object  # ModuleRunner on CUDA, or a runner with a capturable `enqueue` (TrtRunner)
    max_graphs: int = 4
    device: str = "cuda"
    stats: dict = field(default_factory=lambda: {"captured": 0, "replayed": 0, "eager": 0, "capture_failed": 0})
    _seen: set = field(default_factory=set)
    _failed: set = field(default_factory=set)
    _graphs: dict = field(default_factory=dict)

    @property
    def name(self) -> str:
        return f"{self.runner.name}+cuda-graph"

    @staticmethod
    def key(feeds: Feeds) -> tuple:
        return tuple(sorted((n, tuple(t.shape), t.dtype, t.device.type) for n, t in feeds.items()))

    def infer(self, feeds: Feeds) -> Feeds:
        feeds = {n: t if t.device.type == self.device else t.to(self.device) for n, t in feeds.items()}
        k = self.key(feeds)
        g = self._graphs.get(k)
        if g is None:
            eager = (feeds["input_ids"].shape[-1] != 1 or k in self._failed or k not in self._seen
                     or len(self._graphs) >= self.max_graphs)
            self._seen.add(k)
            if not eager:
                try:
                    g = self._graphs[k] = self._capture(feeds)
                    self.stats["captured"] += 1
                except Exception:  # noqa: BLE001 - a step that syncs or allocates outside the pool: stay eager
                    self._failed.add(k)
                    self.stats["capture_failed"] += 1
            if g is None:
                self.stats["eager"] += 1
                return self.runner.infer(feeds)
        for n, t in feeds.items():
            if t.data_ptr() != g.inputs[n].data_ptr():
                g.inputs[n].copy_(t)
        g.graph.replay()
        self.stats["replayed"] += 1
        return g.outputs

    def _capture(self, feeds: Feeds) -> _Graph:
        static = {n: t.clone() for n, t in feeds.items()}
        step = getattr(self.runner, "enqueue", self.runner.infer)
        graph, outputs = self._record(lambda: dict(step(static)))
        return _Graph(graph, static, outputs)

    @staticmethod
    def _record(step: Callable[[], Feeds]) -> tuple[object, Feeds]:
        """(CUDA graph of `step`, its output buffers): one warm-up run on a side stream, then the capture."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            step()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outputs = step()
        return graph, outputs


def cuda_graph_unavailable(runner) -> str | None:
    """Why `runner`'s decode steps cannot be CUDA graphs here (None if they can)."""
    if not torch.cuda.is_available():
        return "no CUDA device (torch.cuda.is_available() is False)"
    name = getattr(runner, "name", type(runner).__name__)
    if hasattr(runner, "enqueue"):  # TensorRT: static bindings, execute_async_v3 captured
        return None
    if getattr(runner, "module", None) is None:
        return f"runner {name} is neither a torch module nor a TensorRT engine (ONNX Runtime: use its own " \
               "enable_cuda_graph session option)"
    device = getattr(runner, "device", None)
    if device != "cuda":
        what = "its package was compiled for" if name == "aoti" else "it runs on"
        return f"runner {name}: {what} {device or 'an unnamed device'}, graphs need CUDA"
    return None


def require_cuda_graph(runner, what: str) -> GraphedRunner:
    """`GraphedRunner(runner)`, or RunnerError `--cuda-graph: <what>: <reason>` (one line)."""
    reason = cuda_graph_unavailable(runner)
    if reason is not None:
        raise RunnerError(f"--cuda-graph: {what}: {reason}")
    return GraphedRunner(runner)


def maybe_graphed(runner, enabled: bool = True) -> tuple[object, str]:
    """(`GraphedRunner(runner)`, "cuda graph") where possible, else (`runner`, the reason)."""
    reason = "disabled" if not enabled else cuda_graph_unavailable(runner)
    if reason is not None:
        return runner, f"no cuda graph: {reason}"
    return GraphedRunner(runner), "cuda graph"
