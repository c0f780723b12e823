"""Greedy decoding with explicit state: one prefill call, then T=1 decode steps carrying the caches."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from .model import K3ForCausalLM
from .state import empty_state


@dataclass
class Generation:
    tokens: torch.Tensor  # [B, new] int64
    prefill_s: float
    decode_s: float

    @property
    def decode_tokens_per_s(self) -> float:
        steps = self.tokens.shape[1] - 1
        return steps * self.tokens.shape[0] / self.decode_s if steps and self.decode_s > 0 else float("nan")


def check_ids(ids: torch.Tensor, vocab_size: int) -> None:
    if ids.dim() != 2 or ids.numel() == 0:
        raise ValueError(f"token ids: expected a non-empty [B, T] array, got shape {list(ids.shape)}")
    if ids.min() < 0 or ids.max() >= vocab_size:
        raise ValueError(f"token ids must be in [0, {vocab_size}), got [{ids.min()}, {ids.max()}]")


@torch.no_grad()
def greedy_generate(model: K3ForCausalLM, prompt: torch.Tensor, max_new_tokens: int) -> Generation:
    """prompt [B, T] int64 -> the next `max_new_tokens` greedy tokens per row."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens}: must be >= 1")
    check_ids(prompt, model.cfg.vocab_size)
    dtype = model.model.embed_tokens.weight.dtype
    device = prompt.device
    t0 = time.perf_counter()
    logits, state = model(prompt, empty_state(model.cfg, prompt.shape[0], dtype, device))
    out = [logits[:, -1].argmax(-1)]
    t1 = time.perf_counter()
    for _ in range(max_new_tokens - 1):
        logits, state = model(out[-1][:, None], state)
        out.append(logits[:, -1].argmax(-1))
    return Generation(torch.stack(out, 1), t1 - t0, time.perf_counter() - t1)


@torch.no_grad()
def full_logits(model: K3ForCausalLM, ids: torch.Tensor) -> torch.Tensor:
    """ids [B, T] -> float32 logits [B, T, vocab] from one forward with an empty state."""
    check_ids(ids, model.cfg.vocab_size)
    dtype = model.model.embed_tokens.weight.dtype
    logits, _ = model(ids, empty_state(model.cfg, ids.shape[0], dtype, ids.device))
    return logits.float()
