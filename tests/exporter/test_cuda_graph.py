"""Decode steps as CUDA graphs (exporter/cuda_graph.py). This machine has no GPU: the tests prove the runner
is left unchanged without CUDA, and the capture policy (second step of a shape, static buffers updated in
place, eager fallback) with the graph emulated on CPU tensors. Real capture and the latency with and without
are measured by bench/gpu_check.py's `bench_decode_graph` on a GPU."""

from __future__ import annotations

import pytest
import torch

from k3x.exporter import cuda_graph
from k3x.exporter.cuda_graph import GraphedRunner, _Graph


class Toy:
    """A runner whose step is a pure function of its feeds: logits = 2 * ids + past, present = past + ids."""
    name = "toy"

    def __init__(self) -> None:
        self.module = torch.nn.Linear(1, 1)  # CPU weights
        self.calls = 0

    def infer(self, feeds):
        self.calls += 1
        ids, past = feeds["input_ids"].float(), feeds["past.0.recurrent"]
        return {"logits": 2 * ids.sum(-1, keepdim=True) + past, "present.0.recurrent": past + ids.sum(-1, keepdim=True)}


class Emulated(GraphedRunner):
    """Treats CPU tensors as device tensors; a "graph" replays the step into the captured output buffers."""

    @staticmethod
    def on_device(feeds):
        return True

    def _capture(self, feeds):
        static = {n: t.clone() for n, t in feeds.items()}
        outputs = {n: t.clone() for n, t in self.runner.infer(static).items()}

        class Replay:
            def replay(_):
                for n, t in self.runner.infer(static).items():
                    outputs[n].copy_(t)

        return _Graph(Replay(), static, outputs)


def _decode(runner, steps=5):
    out = runner.infer({"input_ids": torch.tensor([[3, 4, 5]]), "past.0.recurrent": torch.zeros(1, 1)})
    seen = [out["logits"].clone()]
    for i in range(steps):
        out = runner.infer({"input_ids": torch.tensor([[i]]), "past.0.recurrent": out["present.0.recurrent"]})
        seen.append(out["logits"].clone())
    return seen


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the path without CUDA")
def test_without_cuda_the_runner_is_unchanged():
    toy = Toy()
    runner, how = cuda_graph.maybe_graphed(toy)
    assert runner is toy and how == "no cuda graph: no CUDA device"
    assert cuda_graph.maybe_graphed(toy, enabled=False)[1] == "no cuda graph: disabled"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the path without CUDA")
def test_cpu_tensors_run_eagerly():
    g = GraphedRunner(Toy())
    assert [t.item() for t in _decode(g)] == [t.item() for t in _decode(Toy())]
    assert g.stats == {"captured": 0, "replayed": 0, "eager": 6, "capture_failed": 0}


def test_second_step_of_a_shape_is_captured_then_replayed_in_place():
    g = Emulated(Toy())
    assert [t.item() for t in _decode(g)] == [t.item() for t in _decode(Toy())]
    # prefill and the first decode step eager, captured at the second, replayed from then on
    assert g.stats == {"captured": 1, "replayed": 4, "eager": 2, "capture_failed": 0}
    (graph,) = g._graphs.values()
    ptr = graph.inputs["past.0.recurrent"].data_ptr()
    g.infer({"input_ids": torch.tensor([[1]]), "past.0.recurrent": graph.outputs["present.0.recurrent"]})
    assert graph.inputs["past.0.recurrent"].data_ptr() == ptr  # static buffer updated in place


def test_growing_shapes_never_capture():
    """A cache that grows each step (the MLA latent) has a new key every step: every step eager, no graphs."""
    g = Emulated(Toy())
    for n in range(1, 5):
        g.infer({"input_ids": torch.tensor([[1]]), "past.0.recurrent": torch.zeros(1, n)})
    assert g.stats["captured"] == 0 and g.stats["eager"] == 4


def test_failed_capture_stays_eager():
    class Broken(Emulated):
        def _capture(self, feeds):
            raise RuntimeError("operation not permitted when stream is capturing")

    g = Broken(Toy())
    assert [t.item() for t in _decode(g)] == [t.item() for t in _decode(Toy())]
    assert g.stats["capture_failed"] == 1 and g.stats["captured"] == 0 and g.stats["eager"] == 6


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the path without CUDA")
def test_pt2_runner_asked_for_graphs_without_cuda_runs_as_before():
    from onnx_mini_folder import mini_export

    from k3x.exporter.runners import ModuleRunner, RunnerOptions, make_runner, start_feeds

    m = mini_export()
    runner = make_runner("pt2", m.folder, RunnerOptions(cuda_graph=True))
    assert type(runner) is ModuleRunner and runner.name == "pt2"
    from k3x.model import preset

    out = runner.infer(start_feeds(preset("k3-mini"), torch.tensor([[1, 2, 3]])))
    assert torch.isfinite(out["logits"]).all()
