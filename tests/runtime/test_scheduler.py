"""Continuous batching as pure bookkeeping: every prompt token and every fed-back token scheduled exactly once and
in order, chunk boundaries under the token budget, admission in input order under slots and blocks, no leak."""

from __future__ import annotations

import pytest
import torch

from k3x.runtime.pools import CacheAllocator
from k3x.runtime.scheduler import Request, Scheduler
from k3x.runtime.step_outputs import consecutive_start

EOS = 99


def _token(rid: int, n: int) -> int:  # a clock-free stand-in for the model: a fixed token per (request, index)
    return EOS if (rid, n) == (3, 1) else 10 * rid + n


def _drive(sched: Scheduler, requests: list[Request], compact: bool = False) -> tuple[dict[int, list[int]], list]:
    """Run the scheduler to the end, checking each step's feeds; -> tokens fed per request, the steps.
    `compact`: as serve() runs it, the running sequences close the gaps after every commit that finished one."""
    for r in requests:
        sched.add(r)
    fed: dict[int, list[int]] = {r.id: [] for r in requests}
    steps = []
    while (step := sched.next_step()) is not None:
        f = step.feeds
        cu, ids = f["cu_seqlens"].tolist(), f["input_ids"].tolist()
        assert cu[0] == 0 and cu[-1] == len(ids) <= sched.max_step_tokens
        assert all(b > a for a, b in zip(cu, cu[1:]))  # every sequence >= 1 token
        assert len(set(f["slots"].tolist())) == len(step.seqs) <= sched.max_sequences
        bs = sched.alloc.block_size
        for b, rid in enumerate(step.seqs):
            end = f["past_lens"][b] + step.lengths[b]
            assert f["past_lens"][b] == len(fed[rid])
            table = sched.alloc.table_of[rid]
            assert f["block_table"][b, : -(-int(end) // bs)].tolist() == table[: -(-int(end) // bs)]
            fed[rid] += ids[cu[b]: cu[b + 1]]
        assert f["block_table"].shape[1] == max(-(-int(p + n) // bs) for p, n in zip(f["past_lens"], step.lengths))
        rows = f["logits_index"].tolist()
        assert [step.seqs[cu.index(r + 1) - 1] for r in rows][: len(step.due)] == list(step.due)
        steps.append(step)
        if sched.commit(step, {rid: _token(rid, len(sched.running[rid].tokens)) for rid in step.due}) and compact:
            sched.compact()
            assert [s.slot for s in sched.running.values()] == list(range(len(sched.running)))  # admission order
            assert all(sched.alloc.slot_of[rid] == s.slot for rid, s in sched.running.items())
    return fed, steps


def test_every_token_once_in_order_and_nothing_leaks():
    lens = [1, 7, 30, 3, 12, 2, 45, 5]
    news = [3, 1, 4, 5, 2, 6, 1, 2]
    reqs = [Request(i, tuple(range(100 + i, 100 + i + n)), m) for i, (n, m) in enumerate(zip(lens, news))]
    alloc = CacheAllocator(slots=3, blocks=12, block_size=4)
    sched = Scheduler(alloc, max_sequences=3, max_step_tokens=8, eos_token_ids=(EOS,))
    fed, steps = _drive(sched, reqs)
    for r in reqs:
        seq = sched.finished[r.id]
        want = [_token(r.id, n) for n in range(r.max_new_tokens)]
        if EOS in want:
            want = want[: want.index(EOS) + 1]
        assert seq.tokens == want
        assert fed[r.id] == list(r.prompt) + seq.tokens[:-1]  # prompt once, then every token but the last
    assert alloc.slots.available == 3 and alloc.blocks.available == 12 and not alloc.table_of
    first_step = {rid: min(i for i, s in enumerate(steps) if rid in s.seqs) for rid in range(len(reqs))}
    assert list(first_step.values()) == sorted(first_step.values())  # admitted in input order
    assert sum(len(s.admitted) for s in steps) == len(reqs)


def test_long_prompt_chunks_and_decodes_share_steps():
    alloc = CacheAllocator(slots=2, blocks=8, block_size=4)
    sched = Scheduler(alloc, max_sequences=2, max_step_tokens=4)
    fed, steps = _drive(sched, [Request(0, (5,), 4), Request(1, tuple(range(10)), 1)])
    # step 0: r0 prefill (1) + r1 chunk 3; then r0 decodes 1 row per step while r1 gets 3, 3, 1
    assert [(s.seqs, s.lengths) for s in steps][:4] == [
        ((0, 1), (1, 3)), ((0, 1), (1, 3)), ((0, 1), (1, 3)), ((0, 1), (1, 1))]
    assert [s.due for s in steps[:4]] == [(0,), (0,), (0,), (0, 1)]
    assert steps[0].feeds["logits_index"].tolist() == [0]
    assert steps[3].feeds["logits_index"].tolist() == [0, 1]


def test_chunk_only_step_asks_for_one_ignored_row():
    sched = Scheduler(CacheAllocator(1, 4, 4), max_sequences=1, max_step_tokens=4)
    _, steps = _drive(sched, [Request(0, tuple(range(10)), 1)])
    assert [s.lengths for s in steps] == [(4,), (4,), (2,)]
    assert [s.due for s in steps] == [(), (), (0,)]
    assert steps[0].feeds["logits_index"].tolist() == [3]  # present, not due


def test_admission_waits_for_blocks_and_refuses_the_impossible():
    alloc = CacheAllocator(slots=4, blocks=3, block_size=4)
    sched = Scheduler(alloc, max_sequences=4, max_step_tokens=64)
    _, steps = _drive(sched, [Request(0, (1,) * 8, 1), Request(1, (2,) * 5, 2)])  # 2 blocks, then 2: one at a time
    assert [s.seqs for s in steps] == [(0,), (1,), (1,)]
    with pytest.raises(ValueError, match="request 5: 13 positions need 4 blocks; the cache has 3"):
        sched.add(Request(5, (1,) * 12, 2))
    with pytest.raises(ValueError, match="max_sequences=0"):
        Scheduler(alloc, max_sequences=0, max_step_tokens=1)
    with pytest.raises(ValueError, match="commit: tokens"):
        sched.add(Request(6, (1,), 1))
        sched.commit(sched.next_step(), {})
    assert torch.is_tensor(steps[0].feeds["input_ids"])


def test_steps_pack_their_sequences_in_slot_order():
    # request 0 finishes first and frees slot 0; request 3 takes it while 1 and 2 decode: every later step
    # packs slot 0 first, so an all-decode step's slots are consecutive (its KDA rows are written in place)
    reqs = [Request(0, (1, 2), 1), Request(1, (3,), 6), Request(2, (4,), 6), Request(3, (5, 6, 7), 4)]
    sched = Scheduler(CacheAllocator(slots=3, blocks=12, block_size=4), max_sequences=3, max_step_tokens=8)
    _, steps = _drive(sched, reqs)
    slots = [s.feeds["slots"].tolist() for s in steps]
    assert all(s == sorted(s) for s in slots)
    assert [0, 1, 2] in slots[2:] and 3 in [r for s in steps[1:] for r in s.admitted]


@pytest.mark.parametrize("budget", [5, 8, 64])
def test_compaction_keeps_every_step_in_consecutive_slots(budget):
    # sequences finish in another order than they came (different lengths and token counts): without
    # compaction their slots leave holes and some steps' slots are not consecutive (the step then gathers its
    # KDA rows and writes them back); with it every step's are, and every token is still fed once in order
    lens = [3, 17, 1, 9, 30, 2, 5, 12, 1, 8]
    news = [6, 1, 9, 2, 3, 8, 1, 4, 7, 2]
    reqs = [Request(i, tuple(range(100 + i, 100 + i + n)), m) for i, (n, m) in enumerate(zip(lens, news))]

    def consecutive(compact: bool) -> list[bool]:
        sched = Scheduler(CacheAllocator(slots=4, blocks=64, block_size=4), max_sequences=4, max_step_tokens=budget)
        fed, steps = _drive(sched, reqs, compact=compact)
        for r in reqs:
            assert fed[r.id] == list(r.prompt) + sched.finished[r.id].tokens[:-1]
        assert sched.alloc.slots.available == 4 and not sched.alloc.slot_of
        return [consecutive_start(st.feeds["slots"]) is not None for st in steps]

    assert not all(consecutive(compact=False))
    assert all(consecutive(compact=True))
