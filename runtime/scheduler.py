"""Continuous batching: which tokens of which sequences go into each serving step.

    sched = Scheduler(CacheAllocator(slots, blocks, block_size), max_sequences=8, max_step_tokens=256)
    for r in requests: sched.add(r)
    while (step := sched.next_step()) is not None:
        outputs = runner.infer(step.feeds)       # + the pools
        if sched.commit(step, {seq: token for each due sequence}):   # some finished
            pools.move_slots(sched.compact())

- Requests wait in input order; the head of the queue is admitted when a slot and the blocks for all the
  positions it may reach (prompt + max_new_tokens - 1) are free and fewer than `max_sequences` run (so the
  order of admission is the input order, and a running sequence never waits for memory).
- Each step packs, in admission order, one decode row per decoding sequence and then prompt chunks of
  prefilling sequences, under `max_step_tokens` (a long prompt is prefilled over several steps).
- A sequence's token is due when the step holds its last prompt row or its decode row; `logits_index` names
  the packed row of every due sequence (a step of prompt chunks only asks for one row it then ignores, so a
  step never has zero logits rows).
- Requests may be added between steps (online admission: `k3x serve`); `cancel` drops one, queued or
  running, freeing what it holds at once.
- A finished sequence (EOS or max_new_tokens) frees its slot and blocks at commit; `compact()` then moves the
  running sequences down to slots 0..n-1 in admission order (the caller moves their KDA rows:
  StatePools.move_slots). A step packs its sequences in slot order and takes rows in admission order, so its
  slots are then consecutive and ONNX Runtime writes its KDA rows in place (runtime/step_outputs.py); with a
  gap the step gathers them and writes them back. A mixed workload (prompts of 1-2,000 tokens, 16-256 new
  tokens, 32 slots, 512-token steps) had a gap in 30-34 % of its steps without it, none with it, for ~3.3 slot
  moves a step (a scheduler-only simulation, 200 requests).
- With a prefix cache (runtime/prefix_cache.py) a request is admitted at its longest cached boundary (`fed`
  starts there, its table starts with the shared blocks), may wait for a prefix in flight, and prefill chunks
  end on snapshot points.
- Speculation (runtime/speculate.py) sets `Sequence.draft` before `next_step`: the draft tokens ride after the
  sequence's unfed tokens, every one of their rows gets logits, and `commit` takes the accepted tokens (a list)
  and advances the state only when every draft was accepted (else the KDA state was not written back: the
  sequence re-feeds its unfed tokens next step).
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
    draft: list[int] = field(default_factory=list)  # speculated tokens to verify in the next step

    @property
    def length(self) -> int:  # prompt + generated tokens
        return len(self.request.prompt) + len(self.tokens)

    def pending(self) -> list[int]:
        """Tokens not yet fed (the rest of the prompt, else the generated ones not in the state: the last,
        more after a rollback), then the draft."""
        return [*self.request.prompt[self.fed:], *self.tokens[max(0, self.fed - len(self.request.prompt)):],
                *self.draft]


@dataclass(frozen=True)
class Step:
    feeds: dict[str, Tensor]  # input_ids, cu_seqlens, past_lens, slots, block_table, logits_index
    seqs: tuple[int, ...]  # request id of each packed sequence b
    lengths: tuple[int, ...]  # tokens of each
    due: tuple[int, ...]  # request ids whose next token is chosen from logits row j (j = position here)
    admitted: tuple[int, ...]  # request ids that took a slot in this step (their KDA slot is reset or loaded)
    drafts: tuple[tuple[int, ...], ...] = ()  # per due sequence: draft tokens fed (logits rows: 1 + len each)

    def advances(self, tokens: dict[int, int | list[int]]) -> list[bool]:
        """Per packed sequence b: whether its state moves past this step's rows (its KDA rows are written
        back) -> False only for a sequence whose drafts were not all accepted (`tokens`: as for commit)."""
        drafted = dict(zip(self.due, self.drafts))
        return [not drafted.get(rid) or len(tokens[rid]) > len(drafted[rid]) for rid in self.seqs]


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
        self.resumed: dict[int, list[int]] = {}  # request id -> tokens generated before its state was saved

    def add(self, request: Request, resumed: list[int] | None = None) -> None:
        """Queue `request`; `resumed`: its whole prompt is already in the state it will be given at admission
        (a state file) and these tokens were generated from it (the first is fed by its first step)."""
        if resumed is not None:
            self.resumed[request.id] = list(resumed)
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
            seq = Sequence(r, self.alloc.admit(r.id, r.positions, hit.blocks), fed=hit.length)
            if r.id in self.resumed:
                seq.fed, seq.tokens = len(r.prompt), list(self.resumed[r.id])
            self.running[r.id] = seq
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
        # packed in slot order: a step of sequences in consecutive slots writes its KDA rows in place
        # (runtime/step_outputs.py); which rows a step takes is decided above, in admission order
        plan = sorted(plan, key=lambda p: p[0].slot)
        ends = [s.fed + len(t) for s, t in plan]
        due = [b for b, (s, _) in enumerate(plan) if ends[b] >= s.length]
        drafts = [tuple(plan[b][0].draft[: ends[b] - plan[b][0].length]) for b in due]  # a chunk may cut it
        width = max(blocks_for(e, self.alloc.block_size) for e in ends)
        feeds = pack_feeds([t for _, t in plan], [s.fed for s, _ in plan], [s.slot for s, _ in plan],
                           [self.alloc.table_row(s.request.id, width) for s, _ in plan],
                           [(b, 1 + len(d)) for b, d in zip(due, drafts)])
        return Step(feeds, tuple(s.request.id for s, _ in plan), tuple(len(t) for _, t in plan),
                    tuple(plan[b][0].request.id for b in due), admitted, tuple(drafts))

    def sequence(self, rid: int) -> Sequence:
        return self.running[rid] if rid in self.running else self.finished[rid]

    def commit(self, step: Step, tokens: dict[int, int | list[int]]) -> list[int]:
        """Record the step as run: positions advance, due sequences take their token (or, speculating, the
        accepted drafts and the next token: a list) -> ids finished now. A sequence whose drafts were not all
        accepted keeps its position (its KDA state was not written back)."""
        if set(tokens) != set(step.due):
            raise ValueError(f"commit: tokens for {sorted(tokens)}, due {sorted(step.due)}")
        done = []
        for rid, n, advance in zip(step.seqs, step.lengths, step.advances(tokens)):
            seq = self.running[rid]
            seq.draft = []
            seq.fed += n if advance else 0
            new = tokens.get(rid, [])
            for t in [new] if isinstance(new, int) else new:
                seq.tokens.append(int(t))
                seq.done = t in self.eos or len(seq.tokens) == seq.request.max_new_tokens
                if seq.done:
                    break
            if seq.done:
                self.alloc.release(rid)
                if self.prefix is not None:
                    self.prefix.forget(rid)
                self.finished[rid] = self.running.pop(rid)
                done.append(rid)
        return done

    def cancel(self, rid: int) -> bool:
        """Drop request `rid` now, queued or running (a client gone, a stop string, an error): its slot, blocks
        and prefix-cache hit are freed at once -> whether it was running (the caller then compacts)."""
        if self.prefix is not None:
            self.prefix.forget(rid)
        self.resumed.pop(rid, None)
        if rid not in self.running:
            self.queue = [r for r in self.queue if r.id != rid]
            return False
        self.running.pop(rid).done = True
        self.alloc.release(rid)
        return True

    def compact(self) -> list[tuple[int, int]]:
        """The running sequences to slots 0..n-1 in admission order -> the (old, new) slot moves the pools must
        make (StatePools.move_slots); called after a commit that finished sequences. A step packs its
        sequences in slot order and its rows go to the decoding sequences and then the prompt chunks in
        admission order, so with no holes its slots are consecutive and it writes its KDA rows in place
        (runtime/step_outputs.py) instead of gathering them and writing them back."""
        moves = self.alloc.compact(list(self.running))
        for seq in self.running.values():
            seq.slot = self.alloc.slot_of[seq.request.id]
        return moves


def pack_feeds(tokens: list[list[int]], past: list[int], slots: list[int], tables: list[list[int]],
               logits_rows: list[tuple[int, int]]) -> dict[str, Tensor]:
    """The step feeds of sequences b (their tokens, positions already in the state, slot, block table row of
    one width); `logits_rows`: (b, r) asks for the last r rows of sequence b (none: the last row of b = 0,
    which the caller ignores: a step never has zero logits rows)."""
    cu = [0]
    for t in tokens:
        cu.append(cu[-1] + len(t))
    i32 = torch.int32
    index = [cu[b + 1] - r + j for b, r in logits_rows for j in range(r)] or [cu[1] - 1]
    return {"input_ids": torch.tensor([t for ts in tokens for t in ts], dtype=torch.int64),
            "cu_seqlens": torch.tensor(cu, dtype=i32), "past_lens": torch.tensor(past, dtype=i32),
            "slots": torch.tensor(slots, dtype=i32), "block_table": torch.tensor(tables, dtype=i32),
            "logits_index": torch.tensor(index, dtype=torch.int64)}
