"""The prefix cache's bookkeeping, without a model: the block hash chain, reference counts on shared blocks, a
sequence never writing into a shared block (copy-on-write by construction), prefill chunks ending on snapshot
points, a request waiting for a prefix in flight, snapshots restored into the slot, LRU eviction under budget."""

from __future__ import annotations

import pytest
import torch

from k3x.model.config import preset
from k3x.runtime.pools import CacheAllocator, StatePools
from k3x.runtime.prefix_cache import PrefixCache, chain_hashes
from k3x.runtime.scheduler import Request, Scheduler

CFG = preset("k3-mini")
BS = 4


def test_chain_hash_names_the_whole_prefix():
    a = list(range(10))
    h = chain_hashes(a, BS, 2)
    assert len(h) == 2 and h == chain_hashes(a[:8] + [99, 98], BS, 2)  # tokens after the full blocks: not hashed
    b = a[:5] + [77] + a[6:]  # block 1 differs
    hb = chain_hashes(b, BS, 2)
    assert hb[0] == h[0] and hb[1] != h[1]
    c = [77] + a[1:]  # block 0 differs: every later hash differs, though block 1's tokens are the same
    assert all(x != y for x, y in zip(chain_hashes(c, BS, 2), h))
    assert chain_hashes([1, 2, 3, 4, 1, 2, 3, 4], BS, 2)[1] != chain_hashes([1, 2, 3, 4], BS, 1)[0]


def test_shared_blocks_are_counted_and_freed_by_the_last_holder():
    a = CacheAllocator(slots=3, blocks=6, block_size=BS)
    a.admit(0, positions=12)  # blocks 0, 1, 2
    a.hold([0, 1])  # the cache keeps the first two
    assert a.can_admit(16, shared=2) and not a.can_admit(16)
    a.admit(1, positions=16, shared=(0, 1))
    assert a.table_of[1] == [0, 1, 3, 4] and a.refs[0] == a.refs[1] == 3 and a.refs[3] == 1
    a.release(0)
    assert a.blocks.available == 2  # block 2 back; 0 and 1 still held
    a.release(1)
    a.drop([0, 1])
    assert a.blocks.available == 6 and not a.refs
    with pytest.raises(ValueError, match="block 5: not in use"):
        a.hold([5])


def test_a_step_never_writes_into_a_shared_block():
    alloc = CacheAllocator(slots=2, blocks=4, block_size=BS)
    pools = StatePools(CFG, slots=2, blocks=4, block_size=BS)
    for t in pools.tensors.values():
        t.fill_(-1.0)
    alloc.admit(0, positions=8)
    alloc.hold([0])
    alloc.admit(1, positions=7, shared=(0,))  # positions 0..3 shared, 4..6 its own
    sched_feeds = {"cu_seqlens": torch.tensor([0, 3], dtype=torch.int32),
                   "past_lens": torch.tensor([BS], dtype=torch.int32), "slots": torch.tensor([1], dtype=torch.int32),
                   "block_table": torch.tensor([alloc.table_row(1, 2)], dtype=torch.int32)}
    outs = {n.replace("pool.", "new."): torch.ones(3 if n.endswith("latent") else 1, *t.shape[-1 if n.endswith(
        "latent") else 1:]) for n, t in pools.tensors.items()}
    pools.write_back(sched_feeds, outs)
    for n, t in pools.tensors.items():
        if n.endswith(".latent"):
            assert torch.all(t[0] == -1) and torch.all(t[2, :3] == 1) and torch.all(t[2, 3] == -1)


def make(prompts, *, budget: int = 1 << 30, blocks: int = 64, slots: int = 4, step_tokens: int = 64, new: int = 1):
    alloc = CacheAllocator(slots, blocks, BS)
    pools = StatePools(CFG, slots=slots, blocks=blocks, block_size=BS)
    prefix = PrefixCache(alloc, pools, budget)
    sched = Scheduler(alloc, max_sequences=slots, max_step_tokens=step_tokens, prefix=prefix)
    for i, p in enumerate(prompts):
        sched.add(Request(i, tuple(p), new))
    return sched, prefix, pools


def drive(sched, prefix, pools) -> list[tuple]:
    """Run to the end with a stand-in model whose KDA state is the count of positions fed: every chunk must
    start from a slot holding its `fed` (a restored snapshot, or zeros) -> the steps' (request, tokens)."""
    steps = []
    while (step := sched.next_step()) is not None:
        for rid in step.admitted:
            prefix.start(rid, sched.alloc.slot_of[rid])
        for rid, n in zip(step.seqs, step.lengths):
            seq = sched.running[rid]
            for name, t in pools.tensors.items():
                if not name.endswith(".latent"):
                    assert torch.all(t[seq.slot] == seq.fed), (rid, seq.fed)
                    t[seq.slot] = seq.fed + n
        prefix.record(step, sched.running, sched.alloc.table_of)
        steps.append(tuple(zip(step.seqs, step.lengths)))
        sched.commit(step, {rid: 0 for rid in step.due})
    return steps


def test_chunks_end_on_snapshot_points_and_a_prefix_in_flight_is_awaited():
    p = list(range(21))
    sched, prefix, pools = make([p, p, p[:11]])
    steps = drive(sched, prefix, pools)
    # 0 runs alone (1 and 2 share its prefix in flight): its chunk ends at 20, the last boundary below 21;
    # then 1 starts from 0's snapshot at 20 (1 token), 2 finds no snapshot at 8 but knows the prefix: cut there
    assert steps == [((0, 20),), ((0, 1), (1, 1), (2, 8)), ((2, 3),)]
    assert prefix.stored == 2 and [sched.finished[i].fed for i in range(3)] == [21, 21, 11]


def test_budget_evicts_the_least_recently_used_snapshot():
    p0, p1, p2 = ([k] * 9 for k in (1, 2, 3))  # each: a snapshot at 8 holding 2 blocks
    sched, prefix, pools = make([p0, p1, p2, p1, p0], slots=1)
    prefix.budget = 2 * prefix.snapshot_bytes + 4 * prefix.block_bytes  # two snapshots and their blocks
    steps = drive(sched, prefix, pools)
    assert [dict(s).get(3) for s in steps if 3 in dict(s)] == [1]  # p1 again: from 8, one token
    assert prefix.evictions == 2 and len(prefix.snapshots) == 2 and prefix.nbytes <= prefix.budget
    # p0 went first (p2 stored), then p2 (p1 was used again, p0 stored): p1 and p0 remain
    assert prefix.match(p1).length == 8 and prefix.match(p0).length == 8 and prefix.match(p2).length == 0


@pytest.mark.parametrize("blocks, first_chunk, evictions", [(4, 8, 2), (5, 1, 0)])
def test_admission_evicts_snapshots_for_blocks(blocks, first_chunk, evictions):
    """Each request needs 3 blocks (9 positions); its snapshot at 8 then holds 2. With 4 blocks p1 needs p0's
    evicted and p0 again needs p1's (a miss: its first chunk is 8 tokens); with 5 both fit (a hit: 1 token)."""
    p0, p1 = [1] * 9, [2] * 9
    sched, prefix, pools = make([p0, p1, p0], blocks=blocks, slots=1)
    steps = drive(sched, prefix, pools)
    assert next(dict(s)[2] for s in steps if 2 in dict(s)) == first_chunk and prefix.evictions == evictions
    assert sched.alloc.blocks.available + len(sched.alloc.refs) == blocks  # nothing leaked


def test_a_zero_budget_caches_nothing():
    p = list(range(9))
    sched, prefix, pools = make([p, p], budget=0)
    steps = drive(sched, prefix, pools)
    assert steps[0] == ((0, 8), (1, 8))  # no waiting for a prefix that will not be kept
    assert not prefix.snapshots and sched.alloc.blocks.available == 64 and prefix.evictions == 2
    with pytest.raises(ValueError, match="budget=-1"):
        PrefixCache(sched.alloc, pools, -1)


def test_room_is_never_made_by_evicting_the_hit_itself():
    """p0's snapshot holds 2 of the 6 blocks; x takes the other 4 while p0 again waits (it needs 2 more):
    its own snapshot is not evicted to make room (nor a snapshot whose blocks are all in use: that frees
    nothing), so it starts from it once x is done."""
    p0 = [1] * 9
    alloc = CacheAllocator(2, 6, BS)
    pools = StatePools(CFG, slots=2, blocks=6, block_size=BS)
    prefix = PrefixCache(alloc, pools, 1 << 30)
    sched = Scheduler(alloc, max_sequences=2, max_step_tokens=64, prefix=prefix)
    for r in (Request(0, tuple(p0), 1), Request(1, tuple(range(2, 14)), 5), Request(2, tuple(p0), 5)):
        sched.add(r)
    steps = drive(sched, prefix, pools)
    assert next(dict(s)[2] for s in steps if 2 in dict(s)) == 1
    assert prefix.evictions == 1  # x's snapshot at 12, for its last block (its snapshot at 8 would free none)
