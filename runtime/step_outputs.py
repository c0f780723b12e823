"""Where a serving step's state outputs land, for runners that write into tensors they are given (ORT IO
binding: a runner with `binds_outputs`).

- In place: when a step's sequences sit in consecutive slots s0..s0+B-1 (in packed order), `new.{i}.conv` and
  `new.{i}.recurrent` are the pool rows `pool[s0:s0+B]` themselves. The graph reads a pool only by gathering
  the step's rows before it computes the state it writes (model/serving.py: the pools are read-only inputs),
  so writing the result over them is safe, and `StatePools.write_back` has nothing left to copy for them.
  Not for a step with drafts: a sequence whose drafts are rejected keeps its pre-step rows. The runner is
  then also given those rows as the pools (`narrowed`), so the graph reads them where they are.
- Scratch: otherwise, and for the step's latents, buffers kept across steps (grown when a step needs more).
  A fresh tensor per step is fresh memory, and first touching it costs page faults: on k3-bench, 32
  sequences' KDA state is 150 MB a step, and the ORT decode step took 192 ms with fresh outputs against
  134 ms when freed memory stayed mapped (glibc MALLOC_MMAP_THRESHOLD_/MALLOC_TRIM_THRESHOLD_, same code;
  bench/serving.py, CPU, 2 threads). With this module and the pool read in place the step is 121-130 ms.

Logits are not given: callers keep them (records' logits), so they are fresh each step. Scratch outputs are
valid until the next step.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .base import Feeds
from .pools import StatePools


def consecutive_start(slots: Tensor) -> int | None:
    """s0 when `slots` is s0, s0+1, ..., else None."""
    s = [int(x) for x in slots.tolist()]
    return s[0] if s and s == list(range(s[0], s[0] + len(s))) else None


class StepOutputs:
    """The output tensors of each step of one deployment's pools (in place or scratch, module docstring)."""

    def __init__(self, pools: StatePools) -> None:
        self.pools = pools
        self._scratch: dict[str, Tensor] = {}

    def for_step(self, feeds: Feeds, first: int | None) -> Feeds:
        """`new.*` tensors for the step of `feeds`: KDA rows in place, `pool[first:first+B]`, when `first` is
        given (the step's slots are first, first+1, ...), else scratch; latents [N, kv_lora + rope] scratch."""
        rows, tokens = feeds["slots"].shape[0], feeds["input_ids"].shape[0]
        out = {}
        for pool_name, new_name in self.pools.names:
            pool = self.pools.tensors[pool_name]
            if pool_name.endswith(".latent"):
                out[new_name] = self._buffer(new_name, (tokens, pool.shape[-1]), pool)
            elif first is not None:
                out[new_name] = pool[first: first + rows]
            else:
                out[new_name] = self._buffer(new_name, (rows, *pool.shape[1:]), pool)
        return out

    def _buffer(self, name: str, shape: tuple[int, ...], like: Tensor) -> Tensor:
        n = math.prod(shape)
        buf = self._scratch.get(name)
        if buf is None or buf.numel() < n:
            buf = self._scratch[name] = torch.empty(n, dtype=like.dtype, device=like.device)
        return buf[:n].view(shape)


def infer_step(runner, feeds: Feeds, outputs: StepOutputs, in_place: bool = True) -> Feeds:
    """One serving step through `runner`, into `outputs`' tensors when the runner binds outputs (else the
    runner's own). In place, the runner is given the step's KDA rows as the pools (`narrowed`)."""
    if not getattr(runner, "binds_outputs", False):
        return runner.infer(feeds)
    first = consecutive_start(feeds["slots"]) if in_place else None
    out = outputs.for_step(feeds, first)
    return runner.infer(feeds if first is None else narrowed(feeds, outputs.pools, first), out=out)


def narrowed(feeds: Feeds, pools: StatePools, first: int) -> Feeds:
    """The same step over the KDA pools cut to its consecutive slots first..first+B-1 (views, no copy), its
    slots renumbered 0..B-1: the step then holds every slot of the pools it is given in order, which the ORT
    body of k3::KDAPacked reads where they are instead of gathering a copy (custom_ops/kda_packed/onnx.py)."""
    rows = feeds["slots"].shape[0]
    cut = {name: pools.tensors[name][first: first + rows] for name, _ in pools.names if not name.endswith(".latent")}
    return {**feeds, **cut, "slots": torch.arange(rows, dtype=feeds["slots"].dtype)}
