"""Shared by the state-check tests (tests/runtime/test_state_check.py, test_serving_state.py): a real runner
behind one injected state bug."""

from __future__ import annotations

import torch


class Corrupts:
    """An honest runner behind one state bug: on the state it is given (`zeroed`, `stale`: the KDA state of
    its previous call, `transposed`: recurrent key/value axes swapped, `one-layer`: layer 3 zeroed) or on
    the state it returns (`bf16`: the recurrent state in bf16). Batch interface (`past.{i}.*`) or serving step
    (`pool.{i}.*`: the pools, whose slot rows are the sequences' states)."""

    def __init__(self, inner, bug: str) -> None:
        self.inner, self.bug, self.name, self.previous = inner, bug, f"{inner.name}+{bug}", None

    def infer(self, feeds):
        kda = [n for n in feeds if n.endswith((".conv", ".recurrent"))]
        given = feeds
        if self.bug == "zeroed":
            feeds = {**feeds, **{n: torch.zeros_like(feeds[n]) for n in kda}}
        elif self.bug == "one-layer":
            feeds = {**feeds, **{n: torch.zeros_like(feeds[n]) for n in kda if n.split(".")[1] == "3"}}
        elif self.bug == "stale":
            feeds = {**feeds, **{n: (self.previous or feeds)[n] for n in kda}}
        elif self.bug == "transposed":
            feeds = {**feeds, **{n: feeds[n].transpose(-1, -2).contiguous() for n in kda if n.endswith("recurrent")}}
        self.previous = {n: given[n] for n in kda}
        out = self.inner.infer(feeds)
        if self.bug == "bf16":
            out = {n: v.bfloat16() if n.endswith("recurrent") else v for n, v in out.items()}
        return out
