"""A CUDA graph emulated on CPU tensors, shared by the graph tests of runtime/ and exporter/ (no GPU here)."""

from __future__ import annotations

from k3x.runtime.cuda_graph import GraphedRunner


class Emulated(GraphedRunner):
    """CPU tensors as device tensors; a "graph" re-runs the captured step into the captured output buffers."""

    def __init__(self, runner) -> None:
        super().__init__(runner, device="cpu")

    @staticmethod
    def _record(step):
        outputs = {n: t.clone() for n, t in step().items()}

        class Replay:
            def replay(_):
                for n, t in step().items():
                    outputs[n].copy_(t)

        return Replay(), outputs
