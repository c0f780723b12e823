"""The state pools of a serving deployment (the serving step's contract: a step reads pools, never writes them).

- KDA layer i: `pool.{i}.conv` [S, 3P, W-1] fp32 and `pool.{i}.recurrent` [S, H, K, V] fp32, one row per slot;
- MLA layer i: `pool.{i}.latent` [NB, BS, kv_lora + rope] (model dtype), fixed-size blocks; sequence b's
  position p lives in block `table[p // BS]`, row `p % BS`.

`CacheAllocator` is pure bookkeeping (free lists of slots and blocks, one block table per sequence, a reference
count per block in use): the scheduler admits with it and never touches a tensor. A block is back on the free
list when its last holder lets go: the sequences whose tables hold it, and the prefix cache
(runtime/prefix_cache.py) for the blocks of a cached prefix, shared copy-on-write (a step writes only positions
>= past_lens, so a sequence never writes into the full blocks of a prefix it was given). `StatePools` holds the tensors and writes a step's new
rows back in place (`write_back`: O(B + N) rows, never a copy of a pool). model/state.py `pool_bytes` sizes
a deployment (what `k3x inspect --context --sequences` prints).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..model.config import K3Config
from ..model.serving import pool_names
from ..model.state import blocks_for, pool_dims


class FreeList:
    """Ids 0..n-1; `take` hands out the lowest free ids (deterministic), `give` returns them."""

    def __init__(self, n: int) -> None:
        self.capacity = n
        self._free = list(range(n - 1, -1, -1))

    @property
    def available(self) -> int:
        return len(self._free)

    def take(self, k: int) -> list[int]:
        if k > len(self._free):
            raise ValueError(f"take {k}: only {len(self._free)} of {self.capacity} free")
        return [self._free.pop() for _ in range(k)]

    def give(self, ids: list[int]) -> None:
        self._free.extend(ids)
        self._free.sort(reverse=True)
        if len(set(self._free)) != len(self._free):
            raise ValueError(f"freed twice: {sorted(ids)}")


class CacheAllocator:
    """Slots and blocks of the sequences being served, by sequence id. Blocks are reserved at admission for
    every position a sequence may reach (prompt + new tokens - 1), so a running sequence never waits."""

    def __init__(self, slots: int, blocks: int, block_size: int) -> None:
        if slots < 1 or blocks < 1 or block_size < 1:
            raise ValueError(f"slots={slots}, blocks={blocks}, block_size={block_size}: each must be >= 1")
        self.block_size = block_size
        self.slots, self.blocks = FreeList(slots), FreeList(blocks)
        self.slot_of: dict[int, int] = {}
        self.table_of: dict[int, list[int]] = {}
        self.refs: dict[int, int] = {}  # holders of each block in use

    def fits_ever(self, positions: int) -> bool:
        return blocks_for(positions, self.block_size) <= self.blocks.capacity

    def can_admit(self, positions: int, shared: int = 0) -> bool:
        return self.slots.available > 0 and blocks_for(positions, self.block_size) - shared <= self.blocks.available

    def admit(self, seq: int, positions: int, shared: tuple[int, ...] = ()) -> int:
        """A slot and the blocks for `positions` for sequence `seq` -> its slot. `shared`: blocks of a cached
        prefix that start its table (held, not copied); the rest are taken from the free list."""
        if seq in self.slot_of:
            raise ValueError(f"sequence {seq}: already admitted")
        need = blocks_for(positions, self.block_size) - len(shared)
        if not self.can_admit(positions, len(shared)):
            raise ValueError(f"sequence {seq}: no slot or not {need} free blocks")
        self.slot_of[seq] = self.slots.take(1)[0]
        self.hold(shared)
        fresh = self.blocks.take(need)
        self.refs.update(dict.fromkeys(fresh, 1))
        self.table_of[seq] = [*shared, *fresh]
        return self.slot_of[seq]

    def hold(self, blocks) -> None:
        """One more holder of each block (in use)."""
        for b in blocks:
            if b not in self.refs:
                raise ValueError(f"block {b}: not in use, cannot be shared")
            self.refs[b] += 1

    def drop(self, blocks) -> None:
        """One holder fewer of each block; a block nobody holds goes back to the free list."""
        for b in blocks:
            self.refs[b] -= 1
            if self.refs[b] == 0:
                del self.refs[b]
                self.blocks.give([b])

    def release(self, seq: int) -> None:
        self.slots.give([self.slot_of.pop(seq)])
        self.drop(self.table_of.pop(seq))

    def compact(self, order: list[int]) -> list[tuple[int, int]]:
        """Slots 0..n-1 to the sequences `order` (every admitted id, in that order) -> (old slot, new slot) of
        each that moved, whose KDA rows the pools must then move (StatePools.move_slots)."""
        if sorted(order) != sorted(self.slot_of):
            raise ValueError(f"compact: order {sorted(order)} is not the admitted sequences {sorted(self.slot_of)}")
        moves = [(self.slot_of[seq], i) for i, seq in enumerate(order) if self.slot_of[seq] != i]
        if moves:
            self.slot_of.update({seq: i for i, seq in enumerate(order)})
            self.slots = FreeList(self.slots.capacity)
            self.slots.take(len(order))
        return moves

    def table_row(self, seq: int, width: int) -> list[int]:
        """The first `width` block ids of `seq`'s table, padded with block 0 (a valid id, never read)."""
        t = self.table_of[seq][:width]
        return t + [0] * (width - len(t))


def pool_shapes(cfg: K3Config, slots: int, blocks: int, block_size: int, dtype: torch.dtype
                ) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Shape and dtype of every pool (model/state.py `pool_dims` at `slots` slots and `blocks` blocks)."""
    sizes = {"slots": slots, "blocks": blocks}
    return {name: (tuple(sizes.get(d, d) for d in dims), dtype if name.endswith(".latent") else torch.float32)
            for name, dims in pool_dims(cfg, block_size).items()}


class StatePools:
    """The pool tensors of one deployment (zeros at start) and the in-place write-back of a step."""

    def __init__(self, cfg: K3Config, *, slots: int, blocks: int, block_size: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> None:
        self.cfg, self.block_size = cfg, block_size
        self.names = pool_names(cfg)
        self.tensors: dict[str, Tensor] = {
            n: torch.zeros(shape, dtype=dt, device=device)
            for n, (shape, dt) in pool_shapes(cfg, slots, blocks, block_size, dtype).items()}

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def reset_slot(self, slot: int) -> None:
        """A new sequence starts from the zero KDA state (its blocks need no reset: only positions it wrote
        are ever read)."""
        for name, t in self.tensors.items():
            if not name.endswith(".latent"):
                t[slot].zero_()

    def save_slot(self, slot: int) -> dict[str, Tensor]:
        """A copy of the KDA state of `slot` (every conv and recurrent row): a prefix-cache snapshot."""
        return {n: t[slot].clone() for n, t in self.tensors.items() if not n.endswith(".latent")}

    def load_slot(self, slot: int, rows: dict[str, Tensor]) -> None:
        """The KDA state of `slot` = a snapshot taken by `save_slot`."""
        for n, row in rows.items():
            self.tensors[n][slot].copy_(row)

    def move_slots(self, moves: list[tuple[int, int]]) -> None:
        """The KDA rows of slot `old` to slot `new` for every (old, new) of `moves` (CacheAllocator.compact), all
        read before any is written (one gather, one index write), so any permutation is safe."""
        if not moves:
            return
        old, new = (torch.tensor(x) for x in zip(*moves))
        for name, t in self.tensors.items():
            if not name.endswith(".latent"):
                t[new.to(t.device)] = t[old.to(t.device)]

    def _positions(self, table: list[int], n: int) -> tuple[Tensor, Tensor]:
        """(block, row) of positions 0..n-1 of the sequence whose block table is `table`."""
        pos = torch.arange(n)
        return torch.tensor(table, dtype=torch.long)[pos // self.block_size], pos % self.block_size

    def save_sequence(self, slot: int, table: list[int], n: int) -> dict[str, Tensor]:
        """A copy of a sequence's whole state: its slot's KDA rows (`save_slot`) and the latent rows of its
        positions 0..n-1 (`pool.{i}.latent` [n, kv_lora + rope]) read through its block table."""
        blocks, rows = self._positions(table, n)
        return {**self.save_slot(slot), **{name: t[blocks.to(t.device), rows.to(t.device)].clone()
                                           for name, t in self.tensors.items() if name.endswith(".latent")}}

    def load_sequence(self, slot: int, table: list[int], state: dict[str, Tensor]) -> None:
        """The state `save_sequence` gave into `slot` and the blocks of `table`."""
        self.load_slot(slot, {n: x for n, x in state.items() if not n.endswith(".latent")})
        for name in (n for n in state if n.endswith(".latent")):
            pool, x = self.tensors[name], state[name]
            blocks, rows = self._positions(table, x.shape[0])
            pool[blocks.to(pool.device), rows.to(pool.device)] = x.to(pool.device, pool.dtype)

    def write_back(self, feeds: dict[str, Tensor], outputs: dict[str, Tensor], keep: list[bool] | None = None
                   ) -> None:
        """conv/recurrent pool[slots[b]] = new[b] (only where keep[b], when given: a speculating sequence
        whose drafts were rejected keeps its pre-step KDA rows), nothing when `new` is already those pool
        rows (runtime/step_outputs.py, in place); the latent row of token (b, t) goes to position
        past_lens[b] + t of sequence b. Index writes of B rows and N rows, in place."""
        cu = feeds["cu_seqlens"].long().cpu()
        lens = cu[1:] - cu[:-1]
        seq_of_row = torch.repeat_interleave(torch.arange(len(lens)), lens)  # [N]
        pos = feeds["past_lens"].long().cpu()[seq_of_row] + torch.arange(int(cu[-1])) - cu[:-1][seq_of_row]
        blocks = feeds["block_table"].long().cpu()[seq_of_row, pos // self.block_size]
        rows = pos % self.block_size
        slots = feeds["slots"].long().cpu()
        kept = slice(None) if keep is None else torch.tensor(keep, dtype=torch.bool).nonzero()[:, 0]
        for pool_name, new_name in self.names:
            pool, new = self.tensors[pool_name], outputs[new_name]
            if pool_name.endswith(".latent"):
                pool[blocks.to(pool.device), rows.to(pool.device)] = new.to(pool.device, pool.dtype)
            elif new.data_ptr() == pool[int(slots[0])].data_ptr():  # written in place by the step
                if keep is not None and not all(keep):
                    raise ValueError(f"{new_name}: written in place, yet a sequence must keep its pre-step rows")
            else:
                pool[slots[kept].to(pool.device)] = new[kept].to(pool.device, pool.dtype)

