"""Decode steps replayed as CUDA graphs: a wrapper over a torch-module runner (pt2 program, eager model) on CUDA.

A decode step launches hundreds of small kernels (KDA's recurrent kernel is a few µs at B=1); launched one by
one from Python, host overhead dominates. `GraphedRunner.infer` captures the step once into a CUDA graph with
static buffers — the step's inputs (`input_ids`, every `past.*`) are copied into them in place and the graph
is replayed; its outputs (`logits`, `present.*`) are the graph's own buffers, valid until the next call
(the decode loop turns them into the next step's `past.*`, which are copied in before the replay overwrites
them).

Notable choices:
- A graph is keyed by every feed's shape and dtype and captured on the SECOND step with that key (so a
  prefill, or a shape seen once, never pays a capture). Recurrent state (KDA's [B, H, K, V], the conv
  windows) has one shape for the whole decode, so KDA layers replay one graph. The MLA latent cache of the
  exported interface grows by one position per step: its key never repeats and such steps run eagerly, as
  before (`stats["eager"]`). Graphs for K3's hybrid layers need a preallocated latent cache with a length
  input — a change of the exported interface, not made here.
- Only on CUDA: `maybe_graphed` returns the runner unchanged (with the reason) without CUDA, for runners that
  are not torch modules (ONNX Runtime, TensorRT have their own graph options), or for CPU-resident modules.
- At most `max_graphs` graphs are kept (each holds a private memory pool); beyond, steps run eagerly.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

Feeds = dict[str, Tensor]


@dataclass
class _Graph:
    graph: object  # torch.cuda.CUDAGraph
    inputs: Feeds  # static input buffers, updated in place
    outputs: Feeds  # the graph's outputs


@dataclass
class GraphedRunner:
    """`infer` of `runner` with repeated-shape decode steps replayed from CUDA graphs."""
    runner: object  # a runner whose infer is a torch module call on CUDA tensors (exporter/runners.ModuleRunner)
    max_graphs: int = 4
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

    @staticmethod
    def on_device(feeds: Feeds) -> bool:
        return all(t.device.type == "cuda" for t in feeds.values())

    def infer(self, feeds: Feeds) -> Feeds:
        k = self.key(feeds)
        g = self._graphs.get(k)
        if g is None:
            eager = (feeds["input_ids"].shape[-1] != 1 or not self.on_device(feeds) or k in self._failed
                     or k not in self._seen or len(self._graphs) >= self.max_graphs)
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
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            self.runner.infer(static)  # warm-up on the capture stream (Triton compiles, allocator settles)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outputs = self.runner.infer(static)
        return _Graph(graph, static, dict(outputs))


def cuda_graph_unavailable(runner) -> str | None:
    """Why `runner`'s decode steps cannot be CUDA graphs here (None if they can)."""
    if not torch.cuda.is_available():
        return "no CUDA device"
    module = getattr(runner, "module", None)
    if module is None:
        return f"runner {getattr(runner, 'name', type(runner).__name__)} is not a torch module"
    params = [p for p in getattr(module, "parameters", lambda: iter(()))()]
    if params and params[0].device.type != "cuda":
        return f"runner {runner.name} holds its weights on {params[0].device.type}"
    return None


def maybe_graphed(runner, enabled: bool = True) -> tuple[object, str]:
    """(`GraphedRunner(runner)`, "cuda graph") where possible, else (`runner`, the reason)."""
    reason = "disabled" if not enabled else cuda_graph_unavailable(runner)
    if reason is not None:
        return runner, f"no cuda graph: {reason}"
    return GraphedRunner(runner), "cuda graph"
