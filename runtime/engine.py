"""One deployment's serving state and its step: the pools, the allocator, the scheduler, the prefix cache and
the samplers of the requests in flight. `serve` (runtime/serve.py, `k3x run --prompts`) and the engine loop of
`k3x serve` (runtime/engine_loop.py) both drive this, so a request is stepped by the same code either way.

    engine = Engine(runner, cfg, EngineSizes(slots=8, blocks=64, block_size=16, max_step_tokens=512))
    engine.add(Request(0, prompt, 16), Sampler(SamplingOptions()))
    while not engine.idle:
        for e in engine.step(): ...          # e.rid's new tokens; e.done once it finished

- Requests may be added between any two steps (online admission); each has its own sampler (temperature,
  top-k, top-p, seed), chosen per logits row, so a greedy request's tokens do not depend on what else runs.
- `cancel(rid)` drops a queued or running request at once: its slot, its blocks and its prefix-cache hit go
  back before the next step, and the running sequences close the gap (`compact`, KDA rows moved).
- A request's sampler that raises fails that request only: its token is replaced by the row's argmax for the
  step (the step's shape stays), then the request is cancelled and reported in `Emitted.error`.
  `fail_step()`: after a step that raised (a runner error), cancels the requests that step held.
- `journal`: None, or a list every successful `add` and every `cancel` is appended to, in order (`("add",
  request)`, `("cancel", rid)`): rank 0 of rank programs sends it to the other ranks at each step boundary
  (runtime/engine_ranks.py), so their engines admit and cancel alike.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

from ..model.state import blocks_for
from .pools import CacheAllocator, StatePools
from .prefix_cache import PrefixCache
from .scheduler import Request, Scheduler, Step
from .speculate import agree_drafts, choose
from .step_outputs import StepOutputs, infer_step


@dataclass(frozen=True)
class EngineSizes:
    slots: int  # sequences in flight
    blocks: int  # MLA latent blocks
    block_size: int
    max_step_tokens: int
    prefix_cache_bytes: int | None = None  # None: no prefix cache


@dataclass
class Emitted:
    """What one step gave request `rid`: its new tokens and the logits rows they came from."""
    rid: int
    tokens: list[int]
    rows: Tensor
    drafted: int = 0  # drafts fed this step (speculation)
    accepted: int = 0  # of them accepted
    done: bool = False  # finished: EOS or max_new_tokens (its slot and blocks are free)
    error: str | None = None  # the request failed (its sampler raised); it is cancelled


class _Guarded:
    """A request's sampler whose exception is kept (the row's argmax stands in) instead of failing the step."""

    def __init__(self, sampler: Callable[[Tensor], Tensor]) -> None:
        self.sampler, self.error = sampler, None

    def __call__(self, logits: Tensor) -> Tensor:
        if self.error is None:
            try:
                return self.sampler(logits)
            except Exception as e:  # noqa: BLE001 - one request's failure, reported for that request
                self.error = f"{type(e).__name__}: {e}"
        return logits.argmax(-1).cpu()


class Engine:
    def __init__(self, runner, cfg, sizes: EngineSizes, *, eos_token_ids: tuple[int, ...] = (),
                 dtype: torch.dtype = torch.float32, device: str | None = None, pool_cfg=None, agree=None,
                 drafter=None) -> None:
        self.runner, self.cfg, self.sizes, self.agree, self.drafter = runner, cfg, sizes, agree, drafter
        self.device = str(device or getattr(runner, "device", None) or "cpu")
        self.alloc = CacheAllocator(sizes.slots, sizes.blocks, sizes.block_size)
        self.pools = StatePools(pool_cfg or cfg, slots=sizes.slots, blocks=sizes.blocks,
                                block_size=sizes.block_size, dtype=dtype, device=self.device)
        self.outputs = StepOutputs(self.pools)
        self.prefix = (None if sizes.prefix_cache_bytes is None else
                       PrefixCache(self.alloc, self.pools, sizes.prefix_cache_bytes))
        self.sched = Scheduler(self.alloc, max_sequences=sizes.slots, max_step_tokens=sizes.max_step_tokens,
                               eos_token_ids=eos_token_ids, prefix=self.prefix)
        self.samplers: dict[int, _Guarded] = {}
        self.resume: dict[int, dict[str, Tensor]] = {}  # request id -> KDA + latent rows to start from
        self.on_prefill: Callable[[int, Tensor], None] | None = None  # (rid, its first token's logits row)
        self.cached: dict[int, int] = {}  # request id -> prompt tokens restored from the prefix cache
        self.admitted: tuple[int, ...] = ()  # the last step's admissions
        self.counts = {"prompt_tokens": 0, "cached_tokens": 0, "drafted": 0, "accepted": 0, "steps": 0}
        self.journal: list[tuple] | None = None  # adds and cancels, in order (rank programs' rank 0)
        self._step: Step | None = None

    @property
    def idle(self) -> bool:
        return self.sched.idle

    def add(self, request: Request, sampler: Callable[[Tensor], Tensor], resumed: list[int] | None = None,
            rows: dict[str, Tensor] | None = None) -> None:
        """Queue `request` (ValueError when it can never be served); `resumed` / `rows`: it starts from a
        saved state (Scheduler.add) whose rows are loaded at admission."""
        if any(t < 0 or t >= self.cfg.vocab_size for t in request.prompt):
            raise ValueError(f"prompt {request.id}: token ids must be in [0, {self.cfg.vocab_size})")
        if self.drafter is not None and not getattr(getattr(sampler, "options", None), "greedy", False):
            raise ValueError("temperature: speculative decoding is greedy only (temperature 0)")
        self.sched.add(request, resumed)
        self.samplers[request.id] = _Guarded(sampler)
        if rows is not None:
            self.resume[request.id] = rows
        if self.journal is not None:
            self.journal.append(("add", request))

    def cancel(self, rid: int) -> None:
        """Drop request `rid` (queued or running) now: slot, blocks and cache references freed."""
        if self.sched.cancel(rid):
            self.pools.move_slots(self.sched.compact())
        self.retire(rid)
        if self.journal is not None:
            self.journal.append(("cancel", rid))

    def retire(self, rid: int) -> None:
        """Forget a finished request's bookkeeping (its tokens were handed on)."""
        self.sched.finished.pop(rid, None)
        self.samplers.pop(rid, None)
        self.resume.pop(rid, None)
        self.cached.pop(rid, None)

    def fail_step(self) -> list[int]:
        """After `step` raised: cancel the requests that step held -> their ids."""
        rids = [] if self._step is None else [r for r in self._step.seqs if r in self.sched.running]
        for rid in rids:
            self.cancel(rid)
        self._step = None
        return rids

    def step(self) -> list[Emitted]:
        """One serving step (nothing when idle) -> what each due request got."""
        if self.drafter is not None:
            self.drafter.propose(self.sched)  # drafts on the decoding sequences, verified by this step
            if self.agree is not None:
                agree_drafts(self.sched, self.drafter.k, self.agree)
        step = self._step = self.sched.next_step()
        self.admitted = () if step is None else step.admitted
        if step is None:
            return []
        self._admit(step)
        feeds = {**step.feeds, **self.pools.tensors}
        out = infer_step(self.runner, feeds, self.outputs, in_place=not any(step.drafts))
        chosen, rows = choose(step, out["logits"], self.samplers, self.agree)
        self.pools.write_back(feeds, out, step.advances(chosen))
        for rid in step.due if self.on_prefill is not None else ():
            if not self.sched.sequence(rid).tokens:
                self.on_prefill(rid, rows[rid][0])
        if self.prefix is not None:
            self.prefix.record(step, self.sched.running, self.alloc.table_of)
        before = {rid: len(self.sched.running[rid].tokens) for rid in step.due}
        if self.sched.commit(step, chosen):  # sequences finished: the others close the gap (consecutive slots)
            self.pools.move_slots(self.sched.compact())
        self._step = None
        self.counts["steps"] += 1
        emitted = []
        for rid, draft in zip(step.due, step.drafts):
            seq = self.sched.sequence(rid)
            new = seq.tokens[before[rid]:]
            self.counts["drafted"] += len(draft)
            self.counts["accepted"] += len(rows[rid]) - 1
            emitted.append(Emitted(rid, new, rows[rid][: len(new)], len(draft), len(rows[rid]) - 1, seq.done,
                                   self.samplers[rid].error))
        for e in emitted:
            if e.error is not None and not e.done:
                self.cancel(e.rid)
        return emitted

    def _admit(self, step: Step) -> None:
        """The KDA slot of each sequence admitted by `step`: its saved state, its prefix-cache hit, or zeros."""
        for rid in step.admitted:
            slot = self.alloc.slot_of[rid]
            seq = self.sched.running[rid]
            self.counts["prompt_tokens"] += len(seq.request.prompt)
            if rid in self.resume:
                self.pools.load_sequence(slot, self.alloc.table_of[rid], self.resume[rid])
                continue
            self.cached[rid] = seq.fed
            self.counts["cached_tokens"] += seq.fed
            if self.prefix is None:
                self.pools.reset_slot(slot)
            else:
                self.prefix.start(rid, slot)

    def in_use(self) -> dict[str, int]:
        """Pool counters: KDA slots and MLA blocks held by sequences, blocks held by the prefix cache alone."""
        held = {b for t in self.alloc.table_of.values() for b in t}
        return {"kda_slots": len(self.alloc.slot_of), "mla_blocks": len(held),
                "cache_blocks": len(set(self.prefix.held) - held) if self.prefix is not None else 0,
                "cache_snapshots": len(self.prefix.snapshots) if self.prefix is not None else 0}


def blocks_for_context(slots: int, positions: int, block_size: int) -> int:
    """Blocks for `slots` sequences of `positions` each (nothing waits for memory at that length)."""
    return slots * blocks_for(positions, block_size)
