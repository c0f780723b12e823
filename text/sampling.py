"""The one sampler and decode loop behind every way k3x generates (eager, pt2, ORT, TensorRT, AOTInductor).

    options = SamplingOptions(max_new_tokens=32, temperature=0.8, top_p=0.9, seed=1, eos_token_ids=(2,))
    gen = decode_loop(prefill, step, prompt, options, on_token=print)

Notable choices:
- Greedy by default (`temperature=0`): argmax, no randomness. Temperatures are finite; logits are shifted
  by their row maximum before the division and the top stays 0, so a tiny temperature (1e-300, 0 as fp32)
  samples among the top tokens rather than producing nan. `top_k` / `top_p` only apply when sampling;
  asking for them with `temperature=0` is refused rather than silently ignored.
- Sampling order as Hugging Face's warpers: logits / temperature -> top-k -> top-p -> softmax -> draw.
  Top-k keeps exactly k tokens (ties broken by index); top-p keeps the smallest set of most likely tokens
  whose probability sum reaches p (the most likely token always stays).
- Draws happen on the CPU from one `torch.Generator` seeded by `seed`, so a seed gives the same tokens
  on every backend whatever device its logits come from (logits are moved as fp32; greedy stays put).
- Stopping: after `max_new_tokens`, or once every row has produced an EOS id; rows that finished earlier
  are padded with their EOS id. The EOS token itself is part of the output.
- The loop is backend-free: `prefill(prompt [B, T]) -> logits [B, V]` of the last position and
  `step(tokens [B, 1]) -> logits [B, V]`; each caller wraps its model or runner (state stays inside).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor


@dataclass(frozen=True)
class SamplingOptions:
    max_new_tokens: int = 16
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    seed: int | None = None  # None = a fresh random seed
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={self.max_new_tokens}: must be >= 1")
        if not (self.temperature >= 0 and math.isfinite(self.temperature)):
            raise ValueError(f"temperature={self.temperature}: must be a finite number >= 0 (0 = greedy)")
        if self.top_k < 0:
            raise ValueError(f"top_k={self.top_k}: must be >= 0 (0 = off)")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p}: must be in (0, 1] (1 = off)")
        if self.seed is not None and not -(1 << 63) <= self.seed < 1 << 64:
            raise ValueError(f"seed={self.seed}: must fit in 64 bits")
        if self.temperature == 0 and (self.top_k or self.top_p < 1):
            raise ValueError("top_k / top_p apply only when sampling: give temperature > 0 (e.g. 1.0)")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def mask_top_k(logits: Tensor, k: int) -> Tensor:
    """logits [B, V] with all but the k largest per row set to -inf (k >= V: unchanged)."""
    if k <= 0 or k >= logits.shape[-1]:
        return logits
    top = logits.sort(dim=-1, descending=True, stable=True).indices[..., :k]  # ties: the lower index wins
    keep = torch.zeros_like(logits, dtype=torch.bool).scatter_(-1, top, True)
    return logits.masked_fill(~keep, float("-inf"))


def mask_top_p(logits: Tensor, p: float) -> Tensor:
    """logits [B, V] with -inf outside the smallest top set whose probability sum reaches p."""
    if p >= 1:
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True, stable=True)
    probs = sorted_logits.softmax(-1)
    drop_sorted = probs.cumsum(-1) - probs >= p  # mass before this token already reaches p
    drop_sorted[..., 0] = False
    drop = torch.zeros_like(drop_sorted).scatter_(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


class Sampler:
    """logits [B, V] of the last position -> next token ids [B] int64 (on the CPU)."""

    def __init__(self, options: SamplingOptions) -> None:
        self.options = options
        self.generator = torch.Generator()
        if options.seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(options.seed)

    def __call__(self, logits: Tensor) -> Tensor:
        o = self.options
        if o.greedy:
            return logits.argmax(-1).cpu()
        shifted = logits.detach().float().cpu()
        shifted = shifted - shifted.amax(-1, keepdim=True)  # <= 0, the top token 0
        scores = torch.where(shifted == 0, 0.0, shifted / o.temperature)  # a tiny temperature: -inf, never nan
        scores = mask_top_p(mask_top_k(scores, o.top_k), o.top_p)
        return torch.multinomial(scores.softmax(-1), 1, generator=self.generator)[:, 0]


@dataclass
class Generation:
    tokens: Tensor  # [B, new] int64, new <= max_new_tokens (shorter when every row hit EOS)
    prefill_s: float
    decode_s: float

    @property
    def decode_tokens_per_s(self) -> float:
        steps = self.tokens.shape[1] - 1
        return steps * self.tokens.shape[0] / self.decode_s if steps and self.decode_s > 0 else float("nan")


def decode_loop(prefill: Callable[[Tensor], Tensor], step: Callable[[Tensor], Tensor], prompt: Tensor,
                options: SamplingOptions, on_token: Callable[[Tensor], None] | None = None) -> Generation:
    """Prefill `prompt` [B, T], then one `step` per new token until max_new_tokens or EOS in every row.
    `on_token(tokens [B])` is called as each token is chosen (streaming)."""
    sample = Sampler(options)
    eos = torch.tensor(options.eos_token_ids, dtype=torch.int64)
    t0 = time.perf_counter()
    token = sample(prefill(prompt))
    t1 = time.perf_counter()
    done = torch.isin(token, eos)
    out = [token]
    if on_token:
        on_token(token)
    while len(out) < options.max_new_tokens and not bool(done.all()):
        token = sample(step(out[-1][:, None].to(prompt.device)))
        token = torch.where(done, out[-1], token)  # a finished row repeats its EOS
        done |= torch.isin(token, eos)
        out.append(token)
        if on_token:
            on_token(token)
    return Generation(torch.stack(out, 1), t1 - t0, time.perf_counter() - t1)
