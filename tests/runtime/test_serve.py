"""The serving step under continuous batching equals the solo eager model (K3ForCausalLM with its growing state):
mixed steps (prompts prefilled in chunks beside decoding sequences, different lengths, admitted as slots free
up), fp32, k3-mini: the logits every token was chosen from and the greedy tokens."""

from __future__ import annotations

import pytest
import torch
from serving_cases import assert_records_match_solo, prompts, solo

from k3x.model import build_model, preset
from k3x.model.serving import K3ServingStep
from k3x.runtime.serve import ServeOptions, StepModuleRunner, serve
from k3x.runtime.step_outputs import consecutive_start
from k3x.text.sampling import SamplingOptions

CFG = preset("k3-mini")
LENGTHS = [1, 2, 5, 9, 13, 21, 3, 40]
NEW = [3, 1, 4, 2, 5, 1, 6, 2]


@pytest.fixture(scope="module")
def model():
    return build_model(CFG, dtype=torch.float32, seed=0).eval()


def eager_runner(model) -> StepModuleRunner:
    step = K3ServingStep(model, kernels="reference")
    return StepModuleRunner("eager", step, step.input_names, step.output_names)


@pytest.mark.parametrize("max_step_tokens", [8, 64])
def test_continuous_batching_equals_solo(model, max_step_tokens):
    ps = prompts(LENGTHS, CFG.vocab_size)
    opts = ServeOptions(max_sequences=3, block_size=4, max_step_tokens=max_step_tokens, keep_logits=True)
    records = serve(eager_runner(model), CFG, ps, SamplingOptions(), opts, max_new_tokens=NEW)
    assert_records_match_solo(model, records, ps, NEW, "eager step")


def test_finished_sequences_leave_no_gap_and_moved_states_stay_exact(model):
    # the first sequences finish early while later ones run on: the survivors move down to close the gap
    # (their KDA rows copied, runtime/pools.py move_slots), so every step's slots are consecutive, and the
    # moved sequences' tokens and logits still equal their solo runs
    ps, news = prompts([2, 3, 11, 6, 1, 9], CFG.vocab_size, seed=5), [1, 2, 7, 5, 6, 3]
    runner, slots = eager_runner(model), []
    infer = runner.infer
    runner.infer = lambda feeds, **kw: slots.append(feeds["slots"]) or infer(feeds, **kw)
    opts = ServeOptions(max_sequences=4, block_size=4, max_step_tokens=8, keep_logits=True)
    records = serve(runner, CFG, ps, SamplingOptions(), opts, max_new_tokens=news)
    assert_records_match_solo(model, records, ps, news, "eager step, compacted slots")
    assert all(consecutive_start(s) is not None for s in slots), slots
    assert any(s[0] == 0 and len(s) > 1 for s in slots[3:])  # slot 0 still in use after the first finished


def test_eos_frees_the_slot_early(model):
    ps = prompts([4, 6, 3], CFG.vocab_size, seed=1)
    first, _ = solo(model, ps[0], 3)
    sampling = SamplingOptions(max_new_tokens=3, eos_token_ids=(first[0],))
    records = serve(eager_runner(model), CFG, ps, sampling, ServeOptions(max_sequences=1, block_size=4))
    assert records[0].tokens == [first[0]]  # stopped at its EOS; the others then ran through the one slot
    for r, p in zip(records[1:], ps[1:]):
        tokens, _ = solo(model, p, 3)
        want = tokens[: tokens.index(first[0]) + 1] if first[0] in tokens else tokens
        assert r.tokens == want


def test_bad_prompt_is_refused_before_anything_runs(model):
    with pytest.raises(ValueError, match=r"prompt 1: token ids must be in \[0, 512\)"):
        serve(eager_runner(model), CFG, [[1], [512]], SamplingOptions())


def test_seeded_sampling_does_not_depend_on_the_batching(model):
    ps = prompts([5, 2, 9, 4], CFG.vocab_size, seed=3)
    sampling = SamplingOptions(max_new_tokens=4, temperature=1.0, seed=11)
    one = serve(eager_runner(model), CFG, ps, sampling, ServeOptions(max_sequences=1, block_size=4))
    many = serve(eager_runner(model), CFG, ps, sampling, ServeOptions(max_sequences=4, block_size=4, max_step_tokens=6))
    assert [r.tokens for r in one] == [r.tokens for r in many]
    assert len({tuple(r.tokens) for r in one}) > 1  # really sampled, per prompt


def test_torch_runs_on_one_thread_around_a_runner_that_computes_outside_it(model):
    """A runner with `torch_threads = 1` (ONNX Runtime, TensorRT) is driven with torch on one thread (its
    OpenMP workers would spin on the runner's cores, runtime/base.py); the caller's setting comes back after,
    also when the loop fails; other runners keep torch's threads."""
    from k3x.runtime.base import torch_threads_for

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        runner, seen = eager_runner(model), []
        infer = runner.infer
        runner.infer = lambda feeds, **kw: seen.append(torch.get_num_threads()) or infer(feeds, **kw)
        ps = prompts([3, 5], CFG.vocab_size, seed=2)
        serve(runner, CFG, ps, SamplingOptions(max_new_tokens=2), ServeOptions(max_sequences=2, block_size=4))
        assert seen and set(seen) == {2}
        runner.torch_threads, seen[:] = 1, []
        serve(runner, CFG, ps, SamplingOptions(max_new_tokens=2), ServeOptions(max_sequences=2, block_size=4))
        assert seen and set(seen) == {1} and torch.get_num_threads() == 2
        # a model drafter running in torch keeps torch's threads for itself (and so for the step)
        from k3x.runtime.speculate import ModelDrafter

        seen[:] = []
        drafter = ModelDrafter(eager_runner(model), CFG, 2, block_size=4)
        serve(runner, CFG, ps, SamplingOptions(max_new_tokens=3), ServeOptions(max_sequences=2, block_size=4),
              drafter=drafter)
        assert seen and set(seen) == {2}
        with pytest.raises(ZeroDivisionError), torch_threads_for(runner):
            assert torch.get_num_threads() == 1
            1 / 0
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
