"""The eager serving step takes the fused KDA decode (k3::kda_decode, one op per KDA layer) exactly on the steps
where every sequence has one token, and serving with it equals the solo eager model; a traced step keeps the
packed path (its graph has no k3::kda_decode node)."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from serving_cases import assert_records_match_solo, prompts
from torch.utils._python_dispatch import TorchDispatchMode

from k3x.model import build_model, preset
from k3x.model.serving import K3ServingStep
from k3x.runtime.serve import ServeOptions, StepModuleRunner, serve
from k3x.text.sampling import SamplingOptions

CFG = preset("k3-mini")


class OpCounter(TorchDispatchMode):
    """Counts the k3 custom ops dispatched (a real dispatch mode, nothing replaced)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "k3":
            self.calls[func.__name__.split(".")[0]] += 1
        return func(*args, **(kwargs or {}))


@pytest.fixture(scope="module")
def model():
    return build_model(CFG, dtype=torch.float32, seed=0).eval()


def run(model, fused: bool) -> tuple[list, Counter]:
    step = K3ServingStep(model, kernels="reference", fused_decode=fused)
    ps = prompts([3, 7, 2], CFG.vocab_size, seed=4)
    opts = ServeOptions(max_sequences=3, block_size=4, max_step_tokens=64, keep_logits=True)
    with OpCounter() as counter:
        records = serve(StepModuleRunner("eager", step, step.input_names, step.output_names), CFG, ps,
                        SamplingOptions(), opts, max_new_tokens=[5, 4, 6])
    assert_records_match_solo(model, records, ps, [5, 4, 6], f"eager step, fused decode {fused}")
    return records, counter.calls


def test_fused_decode_on_all_decode_steps_only(model):
    kda_layers = sum(1 for t in CFG.layer_types if t == "kda")
    _, fused = run(model, True)
    _, packed = run(model, False)
    assert fused["kda_decode"] > 0 and fused["kda_decode"] % kda_layers == 0
    assert packed["kda_decode"] == 0
    # every decode-only step moved from kda_packed to kda_decode, one op per KDA layer; prefill steps stayed
    assert fused["kda_packed"] + fused["kda_decode"] == packed["kda_packed"] and fused["kda_packed"] > 0


def test_traced_step_keeps_the_packed_path(model):
    """torch.export of the step at a decode-shaped example (3 sequences of one token, N and B dynamic): the
    graph has k3::kda_packed and no k3::kda_decode (the choice is never baked into a graph)."""
    from k3x.exporter import serving as es

    ids, cu, past, slots, table, rows, pools = es.example_inputs(CFG, 4, dtype=torch.float32, device="cpu")
    decode = (ids[:3], torch.arange(4, dtype=torch.int32), past, slots, table, torch.arange(3), pools)
    step = K3ServingStep(model, kernels="reference")
    with torch.no_grad():
        ep = torch.export.export(step, decode, dynamic_shapes=es._dynamic_shapes(CFG))  # noqa: SLF001
    targets = {str(n.target) for n in ep.graph.nodes if n.op == "call_function"}
    assert any("kda_packed" in t for t in targets) and not any("kda_decode" in t for t in targets)
