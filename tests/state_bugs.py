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


class ReturnsTransposed(Corrupts):
    """An honest runner whose returned recurrent states have their key and value axes swapped."""

    def __init__(self, inner) -> None:
        super().__init__(inner, "returns-transposed")

    def infer(self, feeds):
        out = self.inner.infer(feeds)
        return {n: v.transpose(-1, -2) if n.endswith("recurrent") else v for n, v in out.items()}


KDA_LAYERS = "layers 0, 1, 3"  # k3-mini's KDA layers
# (bug, the start of the finding that names it) for a k3-mini pt2 runner checked over a prefill and 2+ decodes
BUG_LINES = [
    ("zeroed", f"pt2+zeroed decode 1: logits: decoded from a zeroed KDA state in {KDA_LAYERS},"),
    ("one-layer", "pt2+one-layer decode 1: logits: decoded from a zeroed KDA state in layer 3,"),
    ("stale", f"pt2+stale decode 2: logits: decoded from the KDA state of one step earlier (stale) in {KDA_LAYERS},"),
    ("transposed", "pt2+transposed decode 1: logits: decoded from a transposed KDA recurrent state (key and value "
                   f"axes swapped) in {KDA_LAYERS},"),
    ("bf16", "pt2+bf16 prefill: layer 0 kda_recurrent: dtype bf16, the contract says fp32"),
]
TRANSPOSED_LINE = ("pt2+returns-transposed prefill: layer 1 kda_recurrent: returned a transposed state (axes head, "
                   "value, key; the contract says head, key, value)")
