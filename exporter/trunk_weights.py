"""A checkpoint's tensors as a CPU-trunk export holds them (`--trunk bf16 | int8`, model/trunk.py), streamed.

`trunk_stream` is `checkpoint.byte_ranges.stream_weights` with the trunk projections' entries in their trunk
form, one tensor at a time (never the model twice):
- dense: the stream unchanged.
- bf16: each trunk weight is read as bf16 (`stream_weights`' `dtypes`): a bf16 checkpoint's bytes are copied
  file to file unchanged (a `StoredTensor`), an fp32 one's rounded once (round to nearest even).
- int8: each trunk weight is read into memory (a copied entry's bytes read back from its ranges) and quantised
  (symmetric absmax per block of 32 along K) into its `qweight` and `scales` entries.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import torch

from ..checkpoint.byte_ranges import StoredTensor, stream_weights
from ..model.config import K3Config
from ..model.init import build_model
from ..model.options import BuildOptions
from ..model.trunk import trunk_entries, trunk_weight_names


def stored_values(t: torch.Tensor | StoredTensor) -> torch.Tensor:
    """An entry's values in memory: a `StoredTensor`'s bytes read from its ranges, in order."""
    if not isinstance(t, StoredTensor):
        return t
    out = torch.empty(t.nbytes, dtype=torch.uint8)
    view, pos = memoryview(out.numpy()), 0
    for r in t.ranges:
        with open(r.file, "rb") as f:
            f.seek(r.offset)
            if f.readinto(view[pos: pos + r.nbytes]) != r.nbytes:
                raise ValueError(f"{r.file}: shorter than its header says (a tensor at {r.offset} + {r.nbytes})")
        pos += r.nbytes
    return out.view(t.dtype).view(t.shape)


def trunk_stream(checkpoint: Path, cfg: K3Config, dtype: torch.dtype, build: BuildOptions
                 ) -> Iterator[tuple[str, torch.Tensor | StoredTensor]]:
    """The checkpoint's entries in state_dict order, the trunk projections' in `build.trunk`'s form."""
    fmt = build.expert_format
    if build.trunk == "dense":
        yield from stream_weights(checkpoint, dtype=dtype, expert_format=fmt)
        return
    names = trunk_weight_names(build_model(cfg, BuildOptions(expert_format=fmt), device="meta", seed=None))
    if build.trunk == "bf16":
        yield from stream_weights(checkpoint, dtype=dtype, expert_format=fmt,
                                  dtypes=dict.fromkeys(names, torch.bfloat16))
        return
    for name, t in stream_weights(checkpoint, dtype=dtype, expert_format=fmt):
        if name in names:
            yield from trunk_entries(name, stored_values(t), build.trunk)
        else:
            yield name, t
