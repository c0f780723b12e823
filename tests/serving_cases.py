"""Shared by the serving tests: random prompts and the solo eager reference (K3ForCausalLM with its growing
state, one prompt alone: a prefill, then one token per call) that continuous batching must reproduce."""

from __future__ import annotations

import torch
from tolerances import assert_close

from k3x.model import empty_state
from k3x.text.sampling import Sampler


def prompts(lengths: list[int], vocab_size: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (n,), generator=g).tolist() for n in lengths]


@torch.no_grad()
def solo(model, prompt: list[int], n: int) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy tokens and the logits each was chosen from, the eager model alone."""
    state = empty_state(model.cfg, 1)
    ids, tokens, logits = torch.tensor([prompt]), [], []
    for _ in range(n):
        out, state = model(ids, state)
        logits.append(out[0, -1])
        tokens.append(int(out[0, -1].argmax()))
        ids = torch.tensor([[tokens[-1]]])
    return tokens, logits


def assert_records_match_solo(model, records, prompt_list: list[list[int]], news: list[int], where: str) -> None:
    """Every record (input order): greedy tokens equal to its solo run, logits within the fp32 tolerance."""
    assert_records_match(records, [solo(model, p, n) for p, n in zip(prompt_list, news)], where)


def assert_records_match(records, want: list[tuple[list[int], list[torch.Tensor]]], where: str,
                         scaled: bool = False) -> None:
    """Every record (input order) against its solo run's (tokens, logits) `want` (`scaled`: tests/tolerances.py)."""
    assert [r.index for r in records] == list(range(len(want)))
    for r, (tokens, logits) in zip(records, want):
        assert r.tokens == tokens, f"{where}: prompt {r.index}"
        for j, (a, e) in enumerate(zip(r.logits, logits)):
            assert_close(a, e, torch.float32, what=f"{where}: prompt {r.index} token {j}", scaled=scaled)


FAILING_SEED = 666  # a request sampled with this seed fails in `FlakySampler`


class FlakySampler(Sampler):
    """The real sampler, except that a request whose seed is FAILING_SEED raises in it (one request failing
    inside the engine loop, the others going on)."""

    def __call__(self, logits):
        if self.options.seed == FAILING_SEED:
            raise RuntimeError("boom")
        return super().__call__(logits)
