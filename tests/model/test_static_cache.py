"""Static (preallocated) MLA latent cache (model/state.py, model/mla.py): same results as the growing cache
over a prefill and 8 decode steps, one shape per decode step, and a clear refusal past the capacity."""

from __future__ import annotations

import pytest
import torch

from k3x.model import build_model, empty_state, preset, state_specs
from k3x.model.config import ConfigError
from k3x.model.options import CacheOptions
from tolerances import assert_close

C = 24  # capacity: prompt 7 + 8 decode steps fit, with unused positions left to mask


STATIC = CacheOptions(C)


def _pair(dtype=torch.float32):
    grow = preset("k3-mini")
    return grow, STATIC, build_model(grow, seed=3, dtype=dtype)


@pytest.mark.parametrize("batch", [1, 2])
def test_static_cache_equals_growing_cache_over_prefill_and_8_steps(batch):
    grow, static, model = _pair()
    prompt = torch.randint(0, grow.vocab_size, (batch, 7), generator=torch.Generator().manual_seed(0))
    specs = state_specs(grow, static)
    assert specs[-1].input_name == "past_length" and specs[-1].output_name == "present_length"
    with torch.no_grad():
        lg, sg = model(prompt, empty_state(grow, batch))
        ls, ss = model(prompt, empty_state(grow, batch, cache=static))
        shapes = set()
        for step in range(9):
            assert_close(ls, lg, torch.float32, f"logits at step {step}")
            length = 7 + step
            assert int(ss[-1]) == length
            for spec, g, s in zip(specs, sg, ss):
                if spec.kind == "latent":
                    assert s.shape == (batch, C, grow.mla.latent_dim)
                    assert_close(s[:, :length], g, torch.float32, f"{spec.output_name} at step {step}")
                    assert not s[:, length:].any(), "positions beyond the length are untouched zeros"
                else:
                    assert_close(s, g, torch.float32, f"{spec.output_name} at step {step}")
            if step:
                shapes.add(tuple(tuple(t.shape) for t in ss))
            tok = lg[:, -1].argmax(-1, keepdim=True)
            lg, sg = model(tok, sg)
            ls, ss = model(tok, ss)
    assert len(shapes) == 1, "every decode step has the same state shapes"


def test_bf16_static_cache_matches_growing():
    grow, static, model = _pair(torch.bfloat16)
    ids = torch.randint(0, grow.vocab_size, (1, 5), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        lg, sg = model(ids, empty_state(grow, 1, torch.bfloat16))
        ls, ss = model(ids, empty_state(grow, 1, torch.bfloat16, cache=static))
        assert {t.dtype for t, sp in zip(ss, state_specs(grow, static)) if sp.kind == 'latent'} == {torch.bfloat16}
        lg, _ = model(ids[:, :1], sg)
        ls, _ = model(ids[:, :1], ss)
    assert_close(ls, lg, torch.bfloat16, "bf16 decode logits")


def test_writing_past_the_capacity_is_refused_in_one_line():
    grow, static, model = _pair()
    state = empty_state(grow, 1, cache=static)
    with torch.no_grad():
        _, state = model(torch.zeros(1, C - 1, dtype=torch.long), state)
        _, state = model(torch.zeros(1, 1, dtype=torch.long), state)  # exactly full
        with pytest.raises(ValueError, match=rf"^past_length {C} \+ 1 new positions = {C + 1}: over the static "
                                             rf"latent cache's capacity max_context={C}$"):
            model(torch.zeros(1, 1, dtype=torch.long), state)


def test_max_context_is_an_option_apart_from_the_architecture():
    """The cache capacity is `CacheOptions`, never part of the config (its dict or hash); it is checked
    against the architecture's context length in one line naming the field."""
    base = preset("k3-mini")
    assert "max_context" not in base.to_dict()
    assert state_specs(base)[-1].kind != "length" and state_specs(base, CacheOptions(64))[-1].kind == "length"
    CacheOptions(base.max_position_embeddings).check(base)
    with pytest.raises(ConfigError, match=r"^max_context=4097: must be None or in \[1, max_position_embeddings="):
        CacheOptions(base.max_position_embeddings + 1).check(base)
    for bad in (0, True, 2.5):
        with pytest.raises(ConfigError, match="^max_context="):
            CacheOptions(bad)
