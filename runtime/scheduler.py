"""Continuous batching: which tokens of which sequences go into each serving step.

    sched = Scheduler(CacheAllocator(slots, blocks, block_size), max_sequences=8, max_step_tokens=256)
    for r in requests: sched.add(r)
    while (step := sched.next_step()) is not None:
        outputs = runner.infer(step.feeds)       # + the pools
        sched.commit(step, {seq: token for each due sequence})

- Requests wait in input order; the head of the queue is admitted when a slot and the blocks for all the
  positions it may reach (prompt + max_new_tokens - 1) are free and fewer than `max_sequences` run (so the
  order of admission is the input order, and a running sequence never waits for memory).
- Each step packs, in admission order, one decode row per decoding sequence and then prompt chunks of
  prefilling sequences, under `max_step_tokens` (a long prompt is prefilled over several steps).
- A sequence's token is due when the step holds its last prompt row or its decode row; `logits_index` names
  the packed row of every due sequence (a step of prompt chunks only asks for one row it then ignores, so a
  step never has zero logits rows).
- A finished sequence (EOS or max_new_tokens) frees its slot and blocks at commit.
- With a prefix cache (runtime/prefix_cache.py) a request is admitted at its longest cached boundary (`fed`
  starts there, its table starts with the shared blocks), may wait for a prefix in flight, and prefill chunks
  end on snapshot points.
Pure bookkeeping on Python lists plus the feed tensors: no model, no clock.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from ..model.state import blocks_for
from .pools import CacheAllocator
from .prefix_cache import NO_HIT, PrefixCache


@dataclass(frozen=True)
class Request:
    id: int  # the caller's index (records come back by it)
    prompt: tuple[int, ...]
    max_new_tokens: int

    @property
    def positions(self) -> int:  # fed to the model in all: the prompt, then every new token but the last
        return len(self.prompt) + self.max_new_tokens - 1


@dataclass
class Sequence:
    request: Request
    slot: int
    fed: int = 0  # positions already in its state
    tokens: list[int] = field(default_factory=list)  # generated so far
    done: bool = False

    def pending(self) -> list[int]:
        """Tokens not yet fed: the rest of the prompt, else the last generated token."""
        prompt = self.request.prompt
        return list(prompt[self.fed:]) if self.fed < len(prompt) else self.tokens[-1:]


@dataclass(frozen=True)
class Step:
    feeds: dict[str, Tensor]  # input_ids, cu_seqlens, past_lens, slots, block_table, logits_index
    seqs: tuple[int, ...]  # request id of each packed sequence b
    lengths: tuple[int, ...]  # tokens of each
    due: tuple[int, ...]  # request ids whose next token is chosen from logits row j (j = position here)
    admitted: tuple[int, ...]  # request ids that took a slot in this step (their KDA slot is reset or loaded)


class Scheduler:
    def __init__(self, allocator: CacheAllocator, *, max_sequences: int, max_step_tokens: int,
                 eos_token_ids: tuple[int, ...] = (), prefix: PrefixCache | None = None) -> None:
        if max_sequences < 1 or max_step_tokens < 1:
            raise ValueError(f"max_sequences={max_sequences}, max_step_tokens={max_step_tokens}: each must be >= 1")
        self.alloc, self.max_sequences, self.max_step_tokens = allocator, max_sequences, max_step_tokens
        self.eos, self.prefix = set(eos_token_ids), prefix
        self.queue: list[Request] = []
        self.running: dict[int, Sequence] = {}  # by request id, in admission order
        self.finished: dict[int, Sequence] = {}

    def add(self, request: Request) -> None:
        if not request.prompt or request.max_new_tokens < 1:
            raise ValueError(f"request {request.id}: needs >= 1 prompt token and max_new_tokens >= 1")
        if not self.alloc.fits_ever(request.positions):
            raise ValueError(f"request {request.id}: {request.positions} positions need "
                             f"{blocks_for(request.positions, self.alloc.block_size)} blocks; the cache has "
                             f"{self.alloc.blocks.capacity} (raise --cache-blocks)")
        self.queue.append(request)

    @property
    def idle(self) -> bool:
        return not self.queue and not self.running

    def _admit(self, budget_left: int) -> list[int]:
        admitted = []
        while self.queue and budget_left - len(admitted) > 0 and len(self.running) < self.max_sequences:
            r = self.queue[0]
            hit = NO_HIT if self.prefix is None else self.prefix.place(r, self.running.values())
            if hit is None or not self.alloc.can_admit(r.positions, len(hit.blocks)):
                break
            self.queue.pop(0)
            self.running[r.id] = Sequence(r, self.alloc.admit(r.id, r.positions, hit.blocks), fed=hit.length)
            admitted.append(r.id)
        return admitted

    def next_step(self) -> Step | None:
        """The next step's rows (None when every request has finished)."""
        if self.idle:
            return None
        plan = self._plan(list(self.running.values()), self.max_step_tokens)
        admitted = self._admit(self.max_step_tokens - sum(len(t) for _, t in plan))
        plan += self._plan([self.running[r] for r in admitted], self.max_step_tokens - sum(len(t) for _, t in plan))
        if not plan:
            raise RuntimeError("scheduler: nothing runs and nothing can be admitted")  # unreachable after add()
        return self._step(plan, tuple(admitted))

    def _plan(self, seqs: list[Sequence], budget: int) -> list[tuple[Sequence, list[int]]]:
        plan = []
        for seq in seqs:
            if budget == 0:
                break
            n = budget if self.prefix is None else self.prefix.chunk(seq, budget)
            plan.append((seq, seq.pending()[:n]))
            budget -= len(plan[-1][1])
        return plan

    def _step(self, plan: list[tuple[Sequence, list[int]]], admitted: tuple[int, ...]) -> Step:
        lens = [len(t) for _, t in plan]
        cu = [0]
        for n in lens:
            cu.append(cu[-1] + n)
        ends = [s.fed + n for (s, _), n in zip(plan, lens)]
        due = [b for b, (s, _) in enumerate(plan) if ends[b] >= len(s.request.prompt)]
        width = max(blocks_for(e, self.alloc.block_size) for e in ends)
        i32 = torch.int32
        feeds = {
            "input_ids": torch.tensor([t for _, ts in plan for t in ts], dtype=torch.int64),
            "cu_seqlens": torch.tensor(cu, dtype=i32),
            "past_lens": torch.tensor([s.fed for s, _ in plan], dtype=i32),
            "slots": torch.tensor([s.slot for s, _ in plan], dtype=i32),
            "block_table": torch.tensor([self.alloc.table_row(s.request.id, width) for s, _ in plan], dtype=i32),
            "logits_index": torch.tensor([cu[b + 1] - 1 for b in (due or [0])], dtype=torch.int64),
        }
        return Step(feeds, tuple(s.request.id for s, _ in plan), tuple(lens),
                    tuple(plan[b][0].request.id for b in due), admitted)

    def commit(self, step: Step, tokens: dict[int, int]) -> list[int]:
        """Record the step as run: positions advance, due sequences take their token -> ids finished now."""
        if set(tokens) != set(step.due):
            raise ValueError(f"commit: tokens for {sorted(tokens)}, due {sorted(step.due)}")
        done = []
        for rid, n in zip(step.seqs, step.lengths):
            seq = self.running[rid]
            seq.fed += n
            if rid in tokens:
                seq.tokens.append(int(tokens[rid]))
                seq.done = tokens[rid] in self.eos or len(seq.tokens) == seq.request.max_new_tokens
            if seq.done:
                self.alloc.release(rid)
                if self.prefix is not None:
                    self.prefix.forget(rid)
                self.finished[rid] = self.running.pop(rid)
                done.append(rid)
        return done
