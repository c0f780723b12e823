"""Decoding with the eager model and explicit state: one prefill call, then T=1 decode steps carrying the caches.
Token choice and stopping are the shared sampler's (text/sampling.py)."""

from __future__ import annotations

import torch

from ..model.model import K3ForCausalLM
from ..model.state import empty_state
from ..text.sampling import Generation, SamplingOptions, decode_loop

__all__ = ["Generation", "check_ids", "full_logits", "generate"]


def check_ids(ids: torch.Tensor, vocab_size: int) -> None:
    if ids.dim() != 2 or ids.numel() == 0:
        raise ValueError(f"token ids: expected a non-empty [B, T] array, got shape {list(ids.shape)}")
    if ids.min() < 0 or ids.max() >= vocab_size:
        raise ValueError(f"token ids must be in [0, {vocab_size}), got [{ids.min()}, {ids.max()}]")


@torch.no_grad()
def generate(model: K3ForCausalLM, prompt: torch.Tensor, options: SamplingOptions,
             on_token=None) -> Generation:
    """prompt [B, T] int64 -> up to `options.max_new_tokens` new tokens per row (greedy unless sampling)."""
    check_ids(prompt, model.cfg.vocab_size)
    dtype = model.model.embed_tokens.weight.dtype
    state = empty_state(model.cfg, prompt.shape[0], dtype, prompt.device)

    def run(ids: torch.Tensor) -> torch.Tensor:
        nonlocal state
        logits, state = model(ids, state)
        return logits[:, -1]

    return decode_loop(run, run, prompt, options, on_token)


@torch.no_grad()
def full_logits(model: K3ForCausalLM, ids: torch.Tensor) -> torch.Tensor:
    """ids [B, T] -> float32 logits [B, T, vocab] from one forward with an empty state."""
    check_ids(ids, model.cfg.vocab_size)
    dtype = model.model.embed_tokens.weight.dtype
    logits, _ = model(ids, empty_state(model.cfg, ids.shape[0], dtype, ids.device))
    return logits.float()
