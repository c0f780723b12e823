"""Sharded loading: one rank's weights read straight from a checkpoint's safetensors shards.

The checkpoint is validated whole from its headers first (checkpoint/files.py: names, shapes, dtypes,
confinement), then the rank's program is materialised at its own size and every tensor is filled from a
`safe_open(...).get_slice(...)` of exactly the rows/columns the plan gives the rank (model/parallel.py):
a rank never holds more than its share plus one tensor being copied. Experts: a rank opens only the
tensors of its own experts (`experts.{e}.w1.weight`, or `weight_packed` + `weight_scale`: the expert axis
is the split, so packed MXFP4 experts are read as they are stored and kept packed, as the single-GPU loader
keeps them — `expert_format="dense"` decodes them instead). `A_log`, stored longer than the head count in K3, is read whole (H floats) and then cut.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..model import mxfp4
from ..model.config import ConfigError, K3Config
from ..model.init import build_model
from ..model.model import K3ForCausalLM
from ..model.parallel import ParallelPlan
from ..model.rank import build_rank_model, set_rank_buffers
from ..plan.kernels import Kernels
from .files import CheckpointError, Shards, checkpoint_config, slot, tensor_files, validate


@torch.no_grad()
def load_rank(path: str | Path, plan: ParallelPlan, rank: int, *, dtype: torch.dtype = torch.float32,
              kernels: Kernels = Kernels.REFERENCE, expert_format: str | None = None,
              activations: str = "bf16") -> tuple[K3Config, K3ForCausalLM]:
    """(the full config, rank `rank`'s module with its weights) from checkpoint folder `path`; experts as
    stored unless `expert_format` says otherwise (checkpoint/files.checkpoint_config)."""
    path = Path(path)
    if not (path / "config.json").is_file():
        raise CheckpointError(f"{path}: no config.json (not a checkpoint folder)")
    if not 0 <= rank < plan.world:
        raise CheckpointError(f"rank={rank}: outside the plan's {plan.world} ranks")
    handles = Shards()
    files = tensor_files(path, handles)
    try:
        cfg, build = checkpoint_config(path, expert_format, files, kernels, activations)
        plan.check(cfg)
    except ConfigError as e:
        raise CheckpointError(str(e)) from None
    entries = validate(cfg, build, files, handles)
    model = build_rank_model(cfg, plan, build, dtype=dtype).to_empty(device="cpu")
    targets = dict(model.named_parameters()) | dict(model.named_buffers())
    full_shapes = {n: tuple(t.shape) for n, t in build_model(cfg, build, device="meta", seed=None).state_dict().items()}
    mine = plan.expert_range(cfg, rank)
    for name, (stored, f) in entries.items():
        s = slot(name)
        packed = targets[s.param].dtype == torch.uint8  # a packed model keeps the bytes and their scales
        if s.part == "weight_shape" or (s.part == "weight_scale" and not packed):
            continue  # informational / consumed with weight_packed
        target, h = targets[s.param + ("_scale" if s.part == "weight_scale" else "")], handles[f]
        if s.expert is not None:
            if s.expert not in mine:
                continue  # another EP rank's expert: never read
            t = h.get_tensor(stored)
            if s.part == "weight_scale" and (t == 0xFF).any():
                raise CheckpointError(f"{stored!r} in {f.name}: mxfp4: weight_scale holds 0xFF, the E8M0 NaN encoding")
            if s.part == "weight_packed" and not packed:
                sstored, sf = entries[name.replace("weight_packed", "weight_scale")]
                try:
                    t = mxfp4.dequantize(t, handles[sf].get_tensor(sstored), torch.float32)
                except ValueError as e:
                    raise CheckpointError(f"{sstored!r} in {sf.name}: {e}") from None
            target[s.expert - mine.start].copy_(t)
        elif s.param.endswith("A_log"):
            full = h.get_tensor(stored).reshape(-1)[: full_shapes[s.param][0]]
            target.copy_(plan.shard(s.param, full, rank))
        else:
            target.copy_(h.get_slice(stored)[plan.index(s.param, full_shapes[s.param], rank)])
    set_rank_buffers(model, cfg, plan, rank)
    return cfg, model.eval()
