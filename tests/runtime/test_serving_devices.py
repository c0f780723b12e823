"""The eager serving step makes every tensor on its inputs' device. A tensor made with no device lands on the
CPU, and with the step's inputs on a GPU the step fails ("expected self and mask to be on the same device"):
found on an H200 in blocked.mla_paged's online-softmax state and causal mask (k3::mla_paged with the reference
kernels, the pt2 serving runner's path). On a CPU-only machine the step's own tensors are CPU tensors either
way, so this test records the factory calls made with no device while the step runs, the ops' bodies
included (torch's factories replaced for the duration: a dispatch or function mode does not reach into a
custom op's implementation)."""

from __future__ import annotations

import traceback
from collections import Counter
from pathlib import Path
from unittest import mock

import pytest
import torch
from serving_cases import prompts

from k3x.model import build_model, preset
from k3x.model.serving import K3ServingStep
from k3x.runtime.serve import ServeOptions, StepModuleRunner, serve
from k3x.text.sampling import SamplingOptions

CFG = preset("k3-mini")
FACTORIES = ("arange", "zeros", "ones", "full", "empty", "tensor", "eye", "randn", "rand", "linspace")


class DevicelessFactories:
    """Counts torch factory calls with no `device` while a watched step runs, by caller file:line."""

    def __init__(self) -> None:
        self.calls: Counter = Counter()

    def wrap(self, name: str, fn):
        def factory(*args, **kwargs):
            if kwargs.get("device") is None:
                caller = traceback.extract_stack(limit=2)[0]
                self.calls[f"torch.{name} at {Path(caller.filename).name}:{caller.lineno}"] += 1
            return fn(*args, **kwargs)
        return factory

    def watch(self, step: K3ServingStep) -> K3ServingStep:
        forward = step.forward

        def watched(*args, **kwargs):
            with mock.patch.multiple(torch, **{n: self.wrap(n, getattr(torch, n)) for n in FACTORIES}):
                return forward(*args, **kwargs)
        step.forward = watched
        return step


@pytest.mark.parametrize("fused", [True, False], ids=["fused-decode", "packed-decode"])
def test_reference_step_makes_nothing_off_its_inputs_device(fused):
    """Prefill chunks, mixed steps and decode steps of three sequences through the reference kernels."""
    lm = build_model(CFG, dtype=torch.float32, seed=0).eval()
    seen = DevicelessFactories()
    step = seen.watch(K3ServingStep(lm, kernels="reference", fused_decode=fused))
    records = serve(StepModuleRunner("eager", step, step.input_names, step.output_names), CFG,
                    prompts([90, 1, 2], CFG.vocab_size, seed=1), SamplingOptions(),
                    ServeOptions(max_sequences=2, block_size=4, max_step_tokens=16), max_new_tokens=[3, 4, 2])
    assert [len(r.tokens) for r in records] == [3, 4, 2]
    assert not seen.calls, dict(seen.calls)


def test_the_watch_sees_inside_the_ops():
    """A factory call with no device inside a custom op's implementation (k3::mla_paged's, reached through the
    dispatcher) is counted."""
    from k3x.custom_ops.mla_paged import blocked

    def deviceless_key_block(block_size, key_block=None):
        return int(torch.tensor(block_size))

    seen = DevicelessFactories()
    lm = build_model(CFG, dtype=torch.float32, seed=0).eval()
    step = seen.watch(K3ServingStep(lm, kernels="reference"))
    with mock.patch.object(blocked, "key_block_for", deviceless_key_block):
        serve(StepModuleRunner("eager", step, step.input_names, step.output_names), CFG, prompts([5], CFG.vocab_size),
              SamplingOptions(), ServeOptions(max_sequences=1, block_size=4), max_new_tokens=[1])
    assert set(seen.calls) == {f"torch.tensor at test_serving_devices.py:"
                               f"{deviceless_key_block.__code__.co_firstlineno + 1}"}, dict(seen.calls)
