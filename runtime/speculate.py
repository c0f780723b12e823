"""Speculative decoding over the serving step (greedy): drafts verified in one step, the KDA state rolled back.

    drafter = NgramDrafter(tokens=4)                        # or ModelDrafter(draft_runner, draft_cfg, 4, ...)
    records = serve(runner, cfg, prompts, SamplingOptions(), options, drafter=drafter)

Each step, `drafter.propose(scheduler)` puts up to K draft tokens on every decoding sequence
(`Sequence.draft`); the scheduler packs them after the sequence's unfed tokens and names every one of their
rows in `logits_index`, so one ordinary serving step verifies them (no new graph). `choose` takes the
greedy token at each row and keeps the drafts while they equal it: a accepted drafts give a + 1 tokens, the
same tokens plain greedy decoding gives (the rows see exactly the prefix plain decoding would have fed).

Rollback. A KDA state cannot be truncated, so a partly rejected step must go back to a state inside the
step. The ways, sized for K3 (`k3x inspect --checkpoint`, model/state.py `state_bytes`: 69 KDA layers,
H=96, K=V=128, fp32):
- per-position states out of the graph, or a window of them: 464.6 MB of KDA state per position per
  sequence (96*128*128*4 B recurrent + conv, x 69 layers; k3-bench 4.8 MB) -> K=4 drafts: 1.86 GB more
  written by every step and held per sequence (a 64-sequence batch: 119 GB, most of an H200), and a new
  output in every target's kda_packed kernel and plugin;
- recompute (what this module does): the step's new KDA rows are written back only when every draft was
  accepted (`Step.advances`, `StatePools.write_back(keep=...)`); otherwise the pool still holds the state
  before the step, the sequence keeps its position, and its unfed tokens (the accepted ones and the new
  token, a + 2 rows) ride at the front of its next step, whose drafts shrink by as many (K + 1 rows in
  all, `draft_length`). Extra memory: none (the new rows are the step's outputs anyway; the target pool is
  the rollback point). Extra work: a + 1 re-fed rows in the next step, in place of drafts: a decode step
  is bound by reading the weights, not by its few rows, so they cost little (bench/speculate.py measures
  the net speed: k3-bench, ORT CPU).
Rejected latent positions are dropped by the position: `past_lens` governs what mla_paged reads, and the
re-fed rows overwrite them.

Drafts: `NgramDrafter` (prompt lookup: the last n <= `ngram` tokens of prompt + generated matched at their
latest earlier occurrence, the tokens after it proposed, continued periodically) and `ModelDrafter` (a second
k3x serving export with its own pools: one batched step feeds each sequence's tokens not yet in its state,
then one row per further draft; its KDA rows after that first step (committed tokens only) are copied as its
rollback point, one draft-model state per sequence, and restored when a fed draft was rejected).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..model.state import blocks_for, state_bytes
from .pools import CacheAllocator, StatePools
from .scheduler import Scheduler, Sequence, Step, pack_feeds


def parse_speculate(text: str) -> int:
    """`ngram:K` -> K (draft tokens per step)."""
    kind, _, k = text.partition(":")
    if kind != "ngram" or not k.isdigit() or int(k) < 1:
        raise ValueError(f"--speculate {text!r}: expected ngram:K with K >= 1 (draft tokens per step)")
    return int(k)


def draft_length(seq: Sequence, k: int) -> int:
    """Drafts `seq`'s next step may carry: K less the unfed tokens beyond the last (after a rollback), and
    none past its max_new_tokens (a + 1 tokens come out of a accepted drafts)."""
    return max(0, min(k + 1 - (seq.length - seq.fed), seq.request.max_new_tokens - len(seq.tokens) - 1))


def decoding(sched: Scheduler, k: int) -> list[tuple[Sequence, int]]:
    """The running sequences that decode, with the drafts each may take (> 0 only)."""
    out = [(s, draft_length(s, k)) for s in sched.running.values() if s.tokens and not s.done]
    return [(s, g) for s, g in out if g > 0]


def lookup(context: list[int], ngram: int, k: int) -> list[int]:
    """Prompt lookup: the longest suffix of `context` (n <= `ngram`) seen before, latest occurrence first ->
    up to `k` tokens that followed it (continued periodically past the end of `context`)."""
    for n in range(min(ngram, len(context) - 1), 0, -1):
        suffix = context[-n:]
        for start in range(len(context) - n - 1, -1, -1):
            if context[start: start + n] == suffix:
                ext = list(context)
                for i in range(start + n, start + n + k):
                    ext.append(ext[i])
                return ext[len(context):]
    return []


class NgramDrafter:
    def __init__(self, tokens: int, ngram: int = 3) -> None:
        self.k, self.ngram = tokens, ngram

    def propose(self, sched: Scheduler) -> None:
        for seq, g in decoding(sched, self.k):
            seq.draft = lookup([*seq.request.prompt, *seq.tokens], self.ngram, g)


class ModelDrafter:
    """Drafts from a second serving export (`runner`, its `cfg`: the target's vocabulary; latent blocks of
    `block_size` positions). Its allocator and pools are sized at the first step for the target scheduler's
    slots and positions."""

    def __init__(self, runner, cfg, tokens: int, *, block_size: int, dtype: torch.dtype = torch.float32,
                 device: str | None = None) -> None:
        self.runner, self.cfg, self.k, self.block_size, self.dtype = runner, cfg, tokens, block_size, dtype
        self.device = str(device or getattr(runner, "device", None) or "cpu")
        self.alloc: CacheAllocator | None = None
        self.pools: StatePools | None = None
        self.fed: dict[int, int] = {}  # request id -> positions in its draft state
        self.fed_drafts: dict[int, list[int]] = {}  # drafts fed past `fed` last round (valid if accepted)
        self.saved: dict[int, dict[str, Tensor]] = {}  # request id -> its KDA rows at `fed` (rollback point)

    def _size(self, sched: Scheduler) -> None:
        """As many slots as the target, blocks for every position its latent blocks hold (+1 a sequence)."""
        slots, target = sched.max_sequences, sched.alloc
        blocks = blocks_for(target.blocks.capacity * target.block_size, self.block_size) + slots
        self.alloc = CacheAllocator(slots, blocks, self.block_size)
        self.pools = StatePools(self.cfg, slots=slots, blocks=blocks, block_size=self.block_size, dtype=self.dtype,
                                device=self.device)

    @property
    def rollback_bytes_per_sequence(self) -> int:  # the saved KDA rows: one draft-model state
        return state_bytes(self.cfg)["kda_state_bytes_per_sequence"]

    def propose(self, sched: Scheduler) -> None:
        if self.alloc is None:
            self._size(sched)
        for rid in [r for r in self.fed if r not in sched.running]:
            self.alloc.release(rid)
            del self.fed[rid], self.fed_drafts[rid], self.saved[rid]
        work = decoding(sched, self.k)
        if not work:
            return
        contexts = [[*s.request.prompt, *s.tokens] for s, _ in work]
        for (seq, _), ctx in zip(work, contexts):
            self._catch_up(seq, ctx)
        drafts = self._run([ctx[self.fed[s.request.id]:] for (s, _), ctx in zip(work, contexts)], work)
        for rid, ctx in zip((s.request.id for s, _ in work), contexts):
            self.fed[rid] = len(ctx)
            self.saved[rid] = self.pools.save_slot(self.alloc.slot_of[rid])
        for j in range(1, max(g for _, g in work)):
            more = [(s, g) for s, g in work if g > j]
            nxt = self._run([[drafts[s.request.id][-1]] for s, _ in more], more, offset=j - 1)
            for rid, d in nxt.items():
                drafts[rid] += d
        for seq, g in work:
            seq.draft = drafts[seq.request.id][:g]
            self.fed_drafts[seq.request.id] = seq.draft[: g - 1]

    def _catch_up(self, seq: Sequence, ctx: list[int]) -> None:
        """Admit a new sequence (empty state); else roll back to the saved point if a fed draft was rejected."""
        rid = seq.request.id
        if rid not in self.fed:
            self.pools.reset_slot(self.alloc.admit(rid, seq.request.positions))
            self.fed[rid], self.fed_drafts[rid] = 0, []
            return
        fed, drafts = self.fed[rid], self.fed_drafts[rid]
        if ctx[fed: fed + len(drafts)] == drafts:
            self.fed[rid] = fed + len(drafts)
            return
        self.pools.load_slot(self.alloc.slot_of[rid], self.saved[rid])

    def _run(self, tokens: list[list[int]], work: list[tuple[Sequence, int]], offset: int = 0
             ) -> dict[int, list[int]]:
        """One draft step: sequence i feeds `tokens[i]` after its fed positions (+ `offset` drafts) -> the
        greedy token after each, by request id."""
        rids = [s.request.id for s, _ in work]
        past = [self.fed[r] + offset for r in rids]
        width = max(blocks_for(p + len(t), self.block_size) for p, t in zip(past, tokens))
        feeds = pack_feeds(tokens, past, [self.alloc.slot_of[r] for r in rids],
                           [self.alloc.table_row(r, width) for r in rids], [(b, 1) for b in range(len(rids))])
        feeds.update(self.pools.tensors)
        out = self.runner.infer(feeds)
        self.pools.write_back(feeds, out)
        return {r: [int(t)] for r, t in zip(rids, out["logits"].argmax(-1).tolist())}


def choose(step: Step, logits: Tensor, samplers, agree=None) -> tuple[dict[int, int | list[int]], dict[int, Tensor]]:
    """The tokens of the due sequences from the step's logits rows: the sampler's token (no drafts), else
    the greedy token at each draft row while the drafts equal it (a accepted -> a + 1 tokens) -> tokens and
    the logits rows they came from, by request id. `agree` (rank programs, dist_run.agree_tokens): every
    rank takes rank 0's token at every row before accepting, so all ranks accept alike."""
    blocks, j = [], 0
    for draft in step.drafts:
        blocks.append(logits[j: j + 1 + len(draft)].float())
        j += 1 + len(draft)
    picks = [int(samplers[rid](b[i: i + 1])[0]) for rid, b in zip(step.due, blocks) for i in range(len(b))]
    if agree is not None and picks:
        picks = agree(picks)
    chosen, rows, j = {}, {}, 0
    for rid, draft, block in zip(step.due, step.drafts, blocks):
        mine, j = picks[j: j + len(block)], j + len(block)
        a = next((i for i, d in enumerate(draft) if d != mine[i]), len(draft))
        chosen[rid] = mine[0] if not draft else mine[: a + 1]
        rows[rid] = block[: a + 1]
    return chosen, rows


def agree_drafts(sched: Scheduler, k: int, agree) -> None:
    """Rank programs: every decoding sequence takes rank 0's drafts (a draft model's argmax need not agree
    bit for bit across ranks; the step's shape follows the drafts). Sizes are fixed by `decoding`, which
    depends only on agreed tokens: each sequence's drafts padded with -1 to its draft length."""
    work = decoding(sched, k)
    flat = [t for s, g in work for t in [*s.draft, *[-1] * (g - len(s.draft))][:g]]
    if not flat:
        return
    got, j = agree(flat), 0
    for seq, g in work:
        seq.draft, j = [t for t in got[j: j + g] if t >= 0], j + g


@dataclass
class Counts:
    """Speculation figures of a run: drafts fed and accepted, tokens and the steps that produced them."""
    drafted: int = 0
    accepted: int = 0
    tokens: int = 0
    steps: int = 0

    def add(self, other: Counts) -> None:
        self.drafted, self.accepted = self.drafted + other.drafted, self.accepted + other.accepted
        self.tokens, self.steps = self.tokens + other.tokens, self.steps + other.steps

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_step(self) -> float:
        return self.tokens / self.steps if self.steps else 0.0
