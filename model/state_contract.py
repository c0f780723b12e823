"""The state contract of an export: what a runner must carry from one step to the next, written
into the manifest's `state` entry, checked when a folder is opened (folder/artifacts.py), by `k3x verify`
(runtime/state_check.py) and by a state file loaded in another process (runtime/state_file.py).

Built from model/state.py `state_specs` only (one source of truth), for the interface the export has:

    {"version": 1, "interface": "batch" | "serving", "latent_block_size": BS | null,
     "tensors": [{"layer", "kind", "input", "output", "shape", "axes", "dtype", "update", "snapshot"}, ...]}

- `kind`: `kda_conv` (the last W-1 pre-conv inputs of q|k|v), `kda_recurrent` (the delta-rule state),
  `mla_latent` (normed c_KV | rope part per position), `length` (static latent cache only: positions held).
- `shape`, `axes`: per sequence (the batch / slot / block axis dropped); `position` is the one dynamic axis.
  kda_conv [3P, W-1] axes (channel, time: oldest first); kda_recurrent [H, K, V] axes (head, key, value):
  o = q . S over `key`, the value read out along `value`; mla_latent [position, kv_lora + rope].
- `dtype`: KDA state fp32 whatever the model dtype; latents in the model dtype.
- Every tensor advances per token. `update`: `replace` (the step returns the whole state after the step,
  which replaces the one it was given) or `append` (serving latents: the step returns only its own positions,
  written at past_lens + t into the sequence's blocks).
- `snapshot`: the finest point a sequence's state can be kept and resumed from. `token` for KDA (any token
  boundary; a snapshot is a copy of the layer's conv and recurrent rows together: a KDA state cannot be cut
  back, only copied or recomputed) and for a growing latent cache (a prefix of positions); `block` for
  the serving latent pool (whole blocks of `latent_block_size` positions, shared by block id).
"""

from __future__ import annotations

from typing import Any

import torch

from ..plan.dtypes import dtype_name
from .config import K3Config
from .options import CacheOptions
from .state import state_specs

CONTRACT_VERSION = 1
KINDS = {"conv": "kda_conv", "recurrent": "kda_recurrent", "latent": "mla_latent", "length": "length"}
AXES = {"conv": ["channel", "time"], "recurrent": ["head", "key", "value"], "latent": ["position", "latent"],
        "length": []}
KDA_KINDS = ("kda_conv", "kda_recurrent")
# the wrong states `k3x verify` recognises a runner decoding from (runtime/state_check.py), by name
WRONG_STATES = {"zeroed": "a zeroed KDA state", "stale": "the KDA state of one step earlier (stale)",
                "transposed": "a transposed KDA recurrent state (key and value axes swapped)"}


def state_contract(cfg: K3Config, dtype: torch.dtype, *, cache: CacheOptions | None = None,
                   block_size: int | None = None) -> dict[str, Any]:
    """The contract of `cfg`'s state: the batch interface (with `cache`), or the serving step's pools when
    `block_size` (the latent pool's) is given."""
    serving = block_size is not None
    tensors = []
    for s in state_specs(cfg, None if serving else cache):
        shape = ["position" if d == "past_seq" else d for d in s.dims[1:]]
        pooled = serving and s.kind == "latent"
        tensors.append({
            "layer": s.layer, "kind": KINDS[s.kind],
            "input": f"pool.{s.layer}.{s.kind}" if serving else s.input_name,
            "output": f"new.{s.layer}.{s.kind}" if serving else s.output_name,
            "shape": ["position", s.dims[-1]] if pooled else shape, "axes": AXES[s.kind],
            "dtype": dtype_name(s.dtype(dtype)), "update": "append" if pooled else "replace",
            "snapshot": "block" if pooled else "token"})
    return {"version": CONTRACT_VERSION, "interface": "serving" if serving else "batch",
            "latent_block_size": block_size, "tensors": tensors}


def tensor_label(t: dict[str, Any]) -> str:
    """How findings name a contract tensor: `layer 3 kda_recurrent`."""
    return "past_length" if t["kind"] == "length" else f"layer {t['layer']} {t['kind']}"


def contract_mismatch(recorded: Any, expected: dict[str, Any]) -> str | None:
    """The first field where `recorded` (a manifest's `state`) disagrees with `expected`, as one phrase;
    None when they agree."""
    if not isinstance(recorded, dict):
        return f"state={str(recorded)[:60]!r} is not a contract object"
    for key in ("version", "interface", "latent_block_size"):
        if recorded.get(key) != expected[key]:
            return f"state.{key}={recorded.get(key)!r}, the config gives {expected[key]!r}"
    got, want = recorded.get("tensors"), expected["tensors"]
    if not isinstance(got, list) or len(got) != len(want):
        n = len(got) if isinstance(got, list) else got
        return f"state.tensors lists {str(n)[:40]} tensors, the config gives {len(want)}"
    for i, (g, w) in enumerate(zip(got, want)):
        if not isinstance(g, dict):
            return f"state.tensors[{i}] is not an object"
        for key, value in w.items():
            if g.get(key) != value:
                return (f"state.tensors[{i}] ({tensor_label(w)}): {key}={str(g.get(key))[:60]}, "
                        f"the config gives {value}")
    return None
