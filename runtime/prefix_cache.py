"""Prefix caching for the hybrid state: KDA snapshots at block boundaries, MLA latent blocks shared copy-on-write.

A KDA state cannot be truncated like a KV cache, so a cached prefix is a *snapshot*: the KDA rows (conv +
recurrent of every KDA layer) of a slot right after a step whose prompt chunk ended at a block boundary
(a multiple of the latent block size BS), plus the MLA pool blocks that hold the latents of those positions.

- Key: a chain hash per full block (h_j = blake2b(h_{j-1} | tokens of block j-1)), as vLLM's block hashes: a
  snapshot at boundary j*BS is found by h_j, which names the whole prefix, not just its last block.
- Sharing: a request whose prompt starts with a cached prefix of j blocks gets those blocks at the head of its
  block table (reference counts in CacheAllocator; no copy) and its slot is loaded from the snapshot; it
  prefills only the rest. A step writes positions >= past_lens only, so nobody writes into a shared full block;
  partial blocks are never cached. At least one prompt token is always prefilled (its logits choose the first
  new token): the longest usable boundary is below the prompt's length.
- Where snapshots are taken: with the cache on, the scheduler ends a prefill chunk at the last boundary below the
  prompt's length, at the end of the prefix the cache already knows (so the next request can start there), and
  rounds chunks cut by the token budget down to a boundary; every chunk that ends on a boundary is snapshotted.
- In flight: a queued request waits while a running sequence is still prefilling a prompt that shares more full
  blocks with it than the cache holds (it would otherwise compute the same prefix twice at once).
- Eviction: least recently used snapshots first, while the cache's bytes (snapshots + blocks only the cache
  holds) exceed the budget, or when an admission needs blocks.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import Counter, OrderedDict
from dataclasses import dataclass
from typing import Iterable

from torch import Tensor

from .pools import CacheAllocator, StatePools


def chain_hashes(tokens, block_size: int, blocks: int) -> list[bytes]:
    """h_1..h_blocks of `tokens`: h_j hashes h_{j-1} and the tokens of block j-1 (h_0 = b"")."""
    out, h = [], b""
    for j in range(blocks):
        h = hashlib.blake2b(h + array("q", tokens[j * block_size:(j + 1) * block_size]).tobytes(),
                            digest_size=16).digest()
        out.append(h)
    return out


def common_prefix(a, b) -> int:
    """Length of the longest common prefix of two token sequences."""
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


@dataclass(frozen=True)
class Hit:
    length: int  # positions restored (a multiple of the block size; 0: none)
    blocks: tuple[int, ...] = ()  # MLA pool blocks of those positions (held by the cache, shared)
    rows: dict[str, Tensor] | None = None  # the KDA snapshot to load into the slot
    known: int = 0  # positions of the prompt the cache has seen in full blocks (>= length): a snapshot point


NO_HIT = Hit(0)


@dataclass(frozen=True)
class Snapshot:
    chain: tuple[bytes, ...]  # h_1..h_j of its prefix (the last is its key)
    blocks: tuple[int, ...]  # MLA pool blocks of positions 0..j*BS-1
    rows: dict[str, Tensor]  # KDA state at position j*BS


class PrefixCache:
    """Snapshots by chain hash (LRU order), the blocks they hold, and the per-request hits; `budget` in bytes."""

    def __init__(self, alloc: CacheAllocator, pools: StatePools, budget: int) -> None:
        if budget < 0:
            raise ValueError(f"prefix cache budget={budget}: must be >= 0 bytes")
        self.alloc, self.pools, self.budget, self.bs = alloc, pools, budget, alloc.block_size
        named = pools.tensors.items()
        self.snapshot_bytes = sum(t[0].numel() * t.element_size() for n, t in named if not n.endswith(".latent"))
        self.block_bytes = sum(t[0].numel() * t.element_size() for n, t in named if n.endswith(".latent"))
        self.snapshots: OrderedDict[bytes, Snapshot] = OrderedDict()
        self.known: Counter[bytes] = Counter()  # chain hashes of every cached prefix's blocks
        self.held: Counter[int] = Counter()  # the cache's holds on each block
        self.hits: dict[int, Hit] = {}  # by request id, while it runs
        self.stored = self.evictions = self.peak_bytes = 0

    @property
    def nbytes(self) -> int:
        """Memory the cache adds: its snapshots and the blocks no running sequence holds."""
        own = sum(1 for b, n in self.held.items() if self.alloc.refs[b] == n)
        return len(self.snapshots) * self.snapshot_bytes + own * self.block_bytes

    # -- admission (scheduler) --
    def match(self, prompt) -> Hit:
        """The longest cached boundary below len(prompt) (LRU touched), and how far the cache knows the prompt."""
        chain = chain_hashes(prompt, self.bs, (len(prompt) - 1) // self.bs)
        known = next((j for j, h in enumerate(chain) if h not in self.known), len(chain))
        for j in range(known, 0, -1):
            snap = self.snapshots.get(chain[j - 1])
            if snap is not None:
                self.snapshots.move_to_end(chain[j - 1])
                return Hit(j * self.bs, snap.blocks, snap.rows, known * self.bs)
        return Hit(0, known=known * self.bs)

    def place(self, request, running: Iterable) -> Hit | None:
        """The hit `request` starts from, with room made for the blocks it still needs (LRU eviction); None
        while a running sequence is prefilling a longer shared prefix (the request waits for its snapshot)."""
        hit = self.match(request.prompt)
        last = (len(request.prompt) - 1) // self.bs * self.bs
        for seq in running if self.budget else ():  # with no budget, nothing will be cached to wait for
            if seq.fed < len(seq.request.prompt):
                shared = min(common_prefix(request.prompt, seq.request.prompt) // self.bs * self.bs, last)
                if shared > hit.length and seq.fed < shared:
                    return None
        self._make_room(-(-request.positions // self.bs) - len(hit.blocks), hit)
        self.hits[request.id] = hit
        return hit

    def _make_room(self, need: int, hit: Hit) -> None:
        """Evict least recently used snapshots that free a block now (one the cache alone holds, through it
        alone), never the hit's own, until `need` blocks are free or none would help."""
        while self.alloc.blocks.available < need:
            key = next((k for k, s in self.snapshots.items()
                        if s.rows is not hit.rows and any(self.alloc.refs[b] == 1 for b in s.blocks)), None)
            if key is None:
                return
            self._evict(key)

    def chunk(self, seq, n: int) -> int:
        """Tokens of `seq`'s next prefill chunk (at most n): ends on a snapshot point when one lies inside."""
        fed, length = seq.fed, len(seq.request.prompt)
        if fed >= length:
            return n
        last = (length - 1) // self.bs * self.bs
        stops = [s for s in (self.hits[seq.request.id].known, last) if fed < s < fed + n]
        if stops:
            return min(stops) - fed
        aligned = (fed + n) // self.bs * self.bs
        return aligned - fed if fed + n < length and aligned > fed else n

    def forget(self, rid: int) -> None:
        self.hits.pop(rid, None)

    # -- state (serve loop) --
    def start(self, rid: int, slot: int) -> None:
        """Before a newly admitted sequence's first step: its slot holds the snapshot of its hit, else zeros."""
        hit = self.hits[rid]
        if hit.rows is None:
            self.pools.reset_slot(slot)
        else:
            self.pools.load_slot(slot, hit.rows)

    def record(self, step, running: dict, tables: dict[int, list[int]]) -> None:
        """After a step's write-back (before commit): snapshot every prompt chunk that ended on a boundary."""
        for rid, n in zip(step.seqs, step.lengths):
            seq = running[rid]
            end = seq.fed + n
            if seq.fed < len(seq.request.prompt) and end % self.bs == 0:
                self._store(seq.request.prompt[:end], tables[rid][: end // self.bs], seq.slot)

    def _store(self, prefix, blocks: list[int], slot: int) -> None:
        chain = tuple(chain_hashes(prefix, self.bs, len(blocks)))
        if chain[-1] in self.snapshots:
            self.snapshots.move_to_end(chain[-1])
            return
        self.alloc.hold(blocks)
        self.held.update(blocks)
        self.known.update(chain)
        self.snapshots[chain[-1]] = Snapshot(chain, tuple(blocks), self.pools.save_slot(slot))
        self.stored += 1
        while self.snapshots and self.nbytes > self.budget:
            self._evict(next(iter(self.snapshots)))
        self.peak_bytes = max(self.peak_bytes, self.nbytes)

    def figures(self) -> dict[str, int]:
        """What the cache did in a run: snapshots taken, evicted and held at the end, and its memory."""
        return {"snapshots_stored": self.stored, "snapshots_evicted": self.evictions,
                "snapshots_held": len(self.snapshots), "snapshot_bytes": self.snapshot_bytes,
                "cache_peak_bytes": self.peak_bytes}

    def _evict(self, key: bytes) -> None:
        snap = self.snapshots.pop(key)
        self.alloc.drop(snap.blocks)
        self.held.subtract(snap.blocks)
        self.known.subtract(snap.chain)
        self.held, self.known = +self.held, +self.known  # drop zero counts
        self.evictions += 1
