"""The one dynamic-dim table of every exported program: (min, opt, max) of batch, seq and past_seq. The
trace uses it for torch.export's dims, the manifest records it, engine builds take their profiles from it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DimRange:
    name: str
    min: int
    opt: int
    max: int


# the one dynamic-dim table: (min, opt, max); opt is what optimisation profiles tune for
DYNAMIC_DIMS: dict[str, DimRange] = {
    "batch": DimRange("batch", 1, 1, 64),
    "seq": DimRange("seq", 1, 128, 4096),
    "past_seq": DimRange("past_seq", 0, 128, 8192),
}
