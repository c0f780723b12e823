"""Decode steps as CUDA graphs (runtime/cuda_graph.py). This machine has no GPU: the tests prove the refusal
without CUDA (one line, before anything loads), which runners may be graphed, and the capture policy (second
step of a shape, static buffers updated in place, eager fallback, a runner's `enqueue` captured in place of
`infer`) with the graph emulated on CPU tensors — including a hybrid k3-mini decode with the static latent
cache, which replays one graph for every decode step after the capture. Real capture (torch.cuda.graph around
a module or TensorRT's execute_async_v3) and the latency with and without are measured by bench/gpu_check.py's
`bench_decode_graph` on a GPU."""

from __future__ import annotations

import pytest
import torch
from emulated_graph import Emulated

from k3x.runtime import cuda_graph
from k3x.runtime.cuda_graph import GraphedRunner, require_cuda_graph
from k3x.runtime.runners import ModuleRunner, RunnerError, RunnerOptions, make_runner, next_feeds, start_feeds


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


def _decode(runner, steps=5):
    out = runner.infer({"input_ids": torch.tensor([[3, 4, 5]]), "past.0.recurrent": torch.zeros(1, 1)})
    seen = [out["logits"].clone()]
    for i in range(steps):
        out = runner.infer({"input_ids": torch.tensor([[i]]), "past.0.recurrent": out["present.0.recurrent"]})
        seen.append(out["logits"].clone())
    return seen


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


def test_a_runner_with_enqueue_is_captured_through_it():
    """TrtRunner's capturable step is `enqueue` (no sync): the graph records it, eager steps still use `infer`."""
    class Engine(Toy):
        enqueued = 0

        def enqueue(self, feeds):
            self.enqueued += 1
            return self.infer(feeds)

    engine = Engine()
    g = Emulated(engine)
    assert [t.item() for t in _decode(g)] == [t.item() for t in _decode(Toy())]
    assert engine.enqueued == 1 + 4  # the (emulated) capture records it once, then 4 replays re-run it
    assert g.stats["replayed"] == 4


def _hybrid_decode(runner, cfg, cache, steps=8):
    out = runner.infer(start_feeds(cfg, torch.tensor([[5, 9, 2, 7]]), cache=cache))
    tokens, logits = [], [out["logits"].clone()]
    for _ in range(steps):
        tok = out["logits"][:, -1].argmax(-1, keepdim=True)
        tokens.append(int(tok))
        out = runner.infer(next_feeds(cfg, out, tok, cache))
        logits.append(out["logits"].clone())
    return tokens, logits


@pytest.mark.parametrize("max_context", [None, 16])
def test_hybrid_decode_replays_one_graph_only_with_the_static_cache(max_context):
    from k3x.model import build_model, preset
    from k3x.model.options import CacheOptions

    cfg, cache = preset("k3-mini"), CacheOptions(max_context)
    model = build_model(cfg, seed=0)
    plain = ModuleRunner("eager", model, cfg, cache=cache)
    graphed = Emulated(ModuleRunner("eager", model, cfg, cache=cache))
    tokens, logits = _hybrid_decode(plain, cfg, cache)
    g_tokens, g_logits = _hybrid_decode(graphed, cfg, cache)
    assert g_tokens == tokens
    for a, b in zip(g_logits, logits):
        assert torch.equal(a, b)
    if max_context is None:  # the latent cache grows: no decode step ever repeats a shape
        assert graphed.stats == {"captured": 0, "replayed": 0, "eager": 9, "capture_failed": 0}
    else:  # prefill and decode step 1 eager, captured at step 2, steps 2..8 replayed
        assert graphed.stats == {"captured": 1, "replayed": 7, "eager": 2, "capture_failed": 0}
        (g,) = graphed._graphs.values()
        assert int(g.inputs["past_length"]) == 4 + 7  # the last replay's length, copied into the static scalar


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the path without CUDA")
def test_cuda_graph_without_cuda_is_refused_in_one_line_before_loading():
    from onnx_mini_folder import mini_export

    for backend in ("pt2", "ort", "eager"):
        with pytest.raises(RunnerError, match=rf"^--cuda-graph: backend {backend}: no CUDA device "
                                              r"\(torch.cuda.is_available\(\) is False\)$"):
            make_runner(backend, mini_export().folder, RunnerOptions(cuda_graph=True))
    with pytest.raises(RunnerError, match="^--cuda-graph: generate: no CUDA device"):
        require_cuda_graph(Toy(), "generate")
    assert cuda_graph.maybe_graphed(Toy())[1] == "no cuda graph: no CUDA device (torch.cuda.is_available() is False)"


def test_which_runners_can_be_graphed(monkeypatch):
    """With CUDA present (patched): modules on CUDA and runners with `enqueue` are graphed; ONNX Runtime, CPU
    modules and AOTI packages compiled for the CPU are refused with the reason."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    cfg_less = ModuleRunner.__new__(ModuleRunner)
    cfg_less.name, cfg_less.module, cfg_less.device = "pt2", object(), "cuda"
    assert isinstance(require_cuda_graph(cfg_less, "backend pt2"), GraphedRunner)
    aoti = ModuleRunner.__new__(ModuleRunner)
    aoti.name, aoti.module, aoti.device = "aoti", object(), "cpu"
    with pytest.raises(RunnerError, match=r"^--cuda-graph: backend aoti: runner aoti: its package was compiled for "
                                          r"cpu, graphs need CUDA$"):
        require_cuda_graph(aoti, "backend aoti")

    class Ort:
        name = "ort"

        def infer(self, feeds):
            return feeds

    with pytest.raises(RunnerError, match="^--cuda-graph: backend ort: runner ort is neither a torch module nor a "
                                          "TensorRT engine"):
        require_cuda_graph(Ort(), "backend ort")

    class Trt(Ort):
        name = "trt"

        def enqueue(self, feeds):
            return feeds

    assert require_cuda_graph(Trt(), "backend trt").name == "trt+cuda-graph"
