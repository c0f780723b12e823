"""The shared sampler: greedy == argmax, seeded sampling reproducible, top-k / top-p masks on known logits,
EOS stopping, and the eager and runner loops going through it."""

from __future__ import annotations

import math

import pytest
import torch

from k3x.model import build_model, preset
from k3x.runtime.generate import generate
from k3x.text.sampling import Sampler, SamplingOptions, decode_loop, mask_top_k, mask_top_p

NEG = float("-inf")


def test_greedy_is_argmax():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    assert torch.equal(Sampler(SamplingOptions())(logits), logits.argmax(-1))


def test_top_k_keeps_exactly_the_k_largest():
    logits = torch.tensor([[1.0, 5.0, 3.0, 4.0, 2.0], [0.0, 0.0, 0.0, 9.0, 0.0]])
    assert torch.equal(mask_top_k(logits, 2), torch.tensor([[NEG, 5.0, NEG, 4.0, NEG], [0.0, NEG, NEG, 9.0, NEG]]))
    assert torch.equal(mask_top_k(logits, 5), logits) and torch.equal(mask_top_k(logits, 0), logits)


def test_top_p_keeps_the_smallest_set_reaching_p():
    probs = torch.tensor([[0.5, 0.05, 0.3, 0.15]])
    logits = probs.log()
    # sorted: 0.5, 0.3, 0.15, 0.05 -> cumulative 0.5, 0.8, 0.95, 1.0
    assert torch.isinf(mask_top_p(logits, 0.5)).tolist() == [[False, True, True, True]]
    assert torch.isinf(mask_top_p(logits, 0.6)).tolist() == [[False, True, False, True]]
    assert torch.isinf(mask_top_p(logits, 0.9)).tolist() == [[False, True, False, False]]
    assert torch.isinf(mask_top_p(logits, 0.01)).tolist() == [[False, True, True, True]]  # the top token stays
    assert torch.equal(mask_top_p(logits, 1.0), logits)


def test_seeded_sampling_is_reproducible_and_follows_the_masks():
    logits = torch.randn(3, 64, generator=torch.Generator().manual_seed(1))
    opts = SamplingOptions(temperature=1.0, seed=5)
    draws = [torch.stack([s(logits) for _ in range(20)]) for s in (Sampler(opts), Sampler(opts))]
    assert torch.equal(draws[0], draws[1])
    assert len(set(draws[0][:, 0].tolist())) > 1  # it really samples
    top3 = logits.topk(3, -1).indices
    s = Sampler(SamplingOptions(temperature=0.7, top_k=3, seed=2))
    for _ in range(30):
        tok = s(logits)
        assert all(int(t) in top3[i].tolist() for i, t in enumerate(tok))


def test_sample_frequencies_match_the_tempered_distribution():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    s = Sampler(SamplingOptions(temperature=2.0, seed=0))
    counts = torch.bincount(torch.cat([s(logits.expand(500, 4)) for _ in range(4)]), minlength=4).float()
    expect = (logits[0] / 2.0).softmax(-1)
    assert torch.allclose(counts / counts.sum(), expect, atol=0.03)


@pytest.mark.parametrize("kwargs, message", [
    ({"max_new_tokens": 0}, "max_new_tokens=0"),
    ({"temperature": -1.0}, "temperature=-1.0"),
    ({"temperature": math.nan}, "temperature=nan"),
    ({"temperature": 1.0, "top_p": 0.0}, "top_p=0.0"),
    ({"temperature": 1.0, "top_k": -2}, "top_k=-2"),
    ({"top_k": 5}, "give temperature > 0"),
])
def test_bad_options_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingOptions(**kwargs)


def test_loop_stops_on_eos_in_every_row_and_pads_finished_rows():
    # row 0 emits EOS (7) at its 2nd token, row 1 at its 4th: 4 tokens, row 0 padded with 7
    script = iter([[1, 2], [7, 3], [5, 4], [6, 7], [9, 9]])

    def logits(_ids):
        return torch.nn.functional.one_hot(torch.tensor(next(script)), 10).float()

    seen = []
    g = decode_loop(logits, logits, torch.zeros(2, 3, dtype=torch.long),
                    SamplingOptions(max_new_tokens=10, eos_token_ids=(7,)), on_token=seen.append)
    assert g.tokens.tolist() == [[1, 7, 7, 7], [2, 3, 4, 7]]
    assert len(seen) == 4 and torch.equal(torch.stack(seen, 1), g.tokens)


def test_eager_generate_greedy_and_seeded():
    model = build_model(preset("k3-mini"), seed=3)
    prompt = torch.tensor([[4, 8, 15, 16]])
    g = generate(model, prompt, SamplingOptions(max_new_tokens=5))
    ids = prompt
    for _ in range(5):  # greedy == argmax of a full forward over the growing sequence
        from k3x.runtime.generate import full_logits

        ids = torch.cat([ids, full_logits(model, ids)[:, -1].argmax(-1, keepdim=True)], 1)
    assert g.tokens.tolist() == ids[:, 4:].tolist()
    opts = SamplingOptions(max_new_tokens=6, temperature=1.5, top_p=0.95, seed=11)
    a, b = generate(model, prompt, opts).tokens, generate(model, prompt, opts).tokens
    assert torch.equal(a, b)
