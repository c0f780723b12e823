"""State pools: allocators (no leak, lowest ids first, refusals), in-place write-back of exactly the step's rows,
and the memory figures `k3x inspect` prints."""

from __future__ import annotations

import pytest
import torch

from k3x.model.config import preset
from k3x.model.state import pool_bytes, state_bytes
from k3x.model.serving import pool_names
from k3x.runtime.pools import CacheAllocator, FreeList, StatePools

CFG = preset("k3-mini")


def test_free_list_lowest_first_and_double_free():
    f = FreeList(4)
    assert f.take(2) == [0, 1]
    f.give([0])
    assert f.take(2) == [0, 2] and f.available == 1
    with pytest.raises(ValueError, match="only 1 of 4"):
        f.take(2)
    with pytest.raises(ValueError, match="freed twice"):
        f.give([0, 0])


def test_allocator_reserves_and_releases():
    a = CacheAllocator(slots=2, blocks=5, block_size=4)
    assert a.admit(7, positions=9) == 0 and a.table_of[7] == [0, 1, 2]  # ceil(9 / 4) blocks
    assert not a.can_admit(9) and a.can_admit(8)
    a.admit(8, positions=8)
    assert not a.can_admit(1)  # no slot left
    assert a.table_row(8, 4) == [3, 4, 0, 0] and a.table_row(7, 2) == [0, 1]
    a.release(7)
    a.release(8)
    assert a.slots.available == 2 and a.blocks.available == 5 and not a.slot_of and not a.table_of
    assert not a.fits_ever(21) and a.fits_ever(20)
    with pytest.raises(ValueError, match="must be >= 1"):
        CacheAllocator(0, 1, 1)


def _step_feeds():
    # two sequences: b0 = slot 2, 3 tokens at positions 3..5 (blocks 4 then 1 at BS 4); b1 = slot 0, 1 token at 0
    return {"cu_seqlens": torch.tensor([0, 3, 4], dtype=torch.int32),
            "past_lens": torch.tensor([3, 0], dtype=torch.int32),
            "slots": torch.tensor([2, 0], dtype=torch.int32),
            "block_table": torch.tensor([[4, 1], [3, 0]], dtype=torch.int32)}


def test_write_back_touches_only_the_step_rows():
    pools = StatePools(CFG, slots=3, blocks=6, block_size=4)
    for t in pools.tensors.values():
        t.fill_(-1.0)
    before = {n: t.clone() for n, t in pools.tensors.items()}
    ptrs = {n: t.data_ptr() for n, t in pools.tensors.items()}
    feeds = _step_feeds()
    outs = {}
    for pool_name, new_name in pool_names(CFG):
        p = pools.tensors[pool_name]
        latent = pool_name.endswith(".latent")
        rows, row_shape = (4, p.shape[2:]) if latent else (2, p.shape[1:])  # N rows of latents, B rows of state
        outs[new_name] = torch.arange(rows, dtype=torch.float32).view(rows, *[1] * len(row_shape)).expand(
            rows, *row_shape).clone()
    pools.write_back(feeds, outs)
    for pool_name, new_name in pool_names(CFG):
        p, old = pools.tensors[pool_name], before[pool_name]
        assert p.data_ptr() == ptrs[pool_name]  # in place
        if pool_name.endswith(".latent"):
            # b0 positions 3, 4, 5: block 4 row 3, block 1 rows 0 and 1; b1 position 0: block 3 row 0
            expect = {(4, 3): 0, (1, 0): 1, (1, 1): 2, (3, 0): 3}
            for (blk, row), v in expect.items():
                assert torch.all(p[blk, row] == v)
                old[blk, row] = v
        else:
            assert torch.all(p[2] == 0) and torch.all(p[0] == 1)
            old[2], old[0] = 0, 1
        assert torch.equal(p, old), pool_name  # nothing else changed


def test_compact_gives_slots_in_order_and_moves_the_rows():
    a = CacheAllocator(slots=4, blocks=8, block_size=4)
    for seq in (10, 11, 12, 13):
        a.admit(seq, positions=4)
    a.release(11)
    assert a.compact([10, 12, 13]) == [(2, 1), (3, 2)]  # slot 0 stays; the others close the gap
    assert a.slot_of == {10: 0, 12: 1, 13: 2} and a.slots.take(1) == [3] and a.slots.available == 0
    assert a.compact([10, 12, 13]) == []  # already in order: nothing moves
    with pytest.raises(ValueError, match=r"not the admitted sequences \[10, 12, 13\]"):
        a.compact([10, 12])

    pools = StatePools(CFG, slots=4, blocks=2, block_size=4)
    for t in pools.tensors.values():
        t.copy_(torch.arange(t.shape[0], dtype=t.dtype).view(-1, *[1] * (t.dim() - 1)).expand_as(t))
    latents = {n: t.clone() for n, t in pools.tensors.items() if n.endswith(".latent")}
    pools.move_slots([(0, 1), (1, 0), (3, 2)])  # a swap reads both rows before writing either
    for n, t in pools.tensors.items():
        if n.endswith(".latent"):
            assert torch.equal(t, latents[n])  # blocks are not slots: untouched
        else:
            assert [int(t[s].flatten()[0]) for s in range(4)] == [1, 0, 3, 3], n
            assert all(torch.all(t[s] == t[s].flatten()[0]) for s in range(4))


def test_reset_slot_zeroes_kda_state_only():
    pools = StatePools(CFG, slots=2, blocks=2, block_size=4)
    for t in pools.tensors.values():
        t.fill_(3.0)
    pools.reset_slot(1)
    for n, t in pools.tensors.items():
        if n.endswith(".latent"):
            assert torch.all(t == 3)
        else:
            assert torch.all(t[1] == 0) and torch.all(t[0] == 3)


def test_pool_bytes_matches_the_allocated_tensors():
    per = state_bytes(CFG, dtype_bytes=4)
    got = pool_bytes(CFG, context=33, sequences=3, block_size=16, dtype=torch.float32)
    assert got["kda_bytes_per_sequence"] == per["kda_state_bytes_per_sequence"]
    assert got["mla_bytes_per_token"] == per["mla_kv_bytes_per_token"] == 3 * 32 * 4  # 3 MLA layers, 24 + 8 wide
    assert got["blocks"] == 9  # 3 blocks of 16 per sequence
    pools = StatePools(CFG, slots=3, blocks=9, block_size=16, dtype=torch.float32)
    assert pools.nbytes == got["total_bytes"] == got["kda_bytes"] + got["mla_bytes"]
    with pytest.raises(ValueError, match="context=0"):
        pool_bytes(CFG, context=0, sequences=1)
