"""Writing a checkpoint: config.json + sharded safetensors + index, in the published layout of the model's
architecture (checkpoint/published.py: `language_model.` names for K3, `A_log` as stored, the
`quantization_config` of packed experts), written whole under a temporary name and renamed into place."""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

from ..fileio import normal_permissions
from ..model import mxfp4
from ..model.config import ConfigError
from ..model.model import K3ForCausalLM
from . import published
from .files import INDEX
from .hf_config import config_to_hf


def _hf_tensors(model: K3ForCausalLM, expert_format: str):
    """Yield (checkpoint name, tensor) in the on-disk layout, model naming (a packed model's experts are written
    as held); `A_log` as the published layout stores it."""
    state = model.state_dict()
    for name, t in state.items():
        m = re.match(r"^(.*\.experts)\.(w[123])(_scale)?$", name)
        if not m:
            yield name, (published.stored_a_log(model.cfg, t) if name.endswith(".A_log") else t).detach().contiguous()
            continue
        if m.group(3):
            continue  # written with its packed weight
        for e in range(t.shape[0]):
            base = f"{m.group(1)}.{e}.{m.group(2)}"
            if t.dtype == torch.uint8:
                if expert_format != "mxfp4":
                    raise ValueError(f"{name}: the model holds MXFP4 experts; expert_format={expert_format!r} "
                                     "would need a decode (save with expert_format='mxfp4')")
                yield f"{base}.weight_packed", t[e].contiguous()
                yield f"{base}.weight_scale", state[f"{name}_scale"][e].contiguous()
            elif expert_format == "mxfp4":
                packed, scale = mxfp4.quantize(t[e])
                yield f"{base}.weight_packed", packed
                yield f"{base}.weight_scale", scale
            else:
                yield f"{base}.weight", t[e].detach().contiguous()


def save_checkpoint(model: K3ForCausalLM, path: str | Path, *, expert_format: str = "mxfp4",
                    max_shard_bytes: int = 2 << 30, extra_files: dict[str, bytes] | None = None) -> Path:
    """Write config.json + sharded safetensors + index atomically (temp folder renamed into place), in the
    published layout of the model's architecture (checkpoint/published.py: names, `A_log`, the
    `quantization_config` of packed experts). `extra_files` ({plain file name: bytes}, e.g. the tokenizer's)
    are written into the same folder."""
    for name in extra_files or {}:
        if Path(name).name != name or name in ("config.json", INDEX) or name.endswith(".safetensors"):
            raise ValueError(f"extra file {name!r}: must be a plain file name other than the checkpoint's own")
    if expert_format not in ("mxfp4", "dense"):
        raise ValueError(f"expert_format={expert_format!r}: expected 'mxfp4' or 'dense'")
    if expert_format == "mxfp4":
        for dim, what in ((model.cfg.expert_dim, "expert input width"), (model.cfg.moe.intermediate_size,
                                                                           "moe.intermediate_size")):
            if dim % mxfp4.BLOCK:
                raise ConfigError(f"{what}={dim}: MXFP4 needs a multiple of {mxfp4.BLOCK}; use expert_format='dense'")
    path = Path(path)
    if path.exists() and any(path.iterdir()):
        raise FileExistsError(f"{path}: exists and is not empty")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))
    try:
        shards: list[dict[str, torch.Tensor]] = [{}]
        size = 0
        for name, t in _hf_tensors(model, expert_format):
            nbytes = t.numel() * t.element_size()
            if shards[-1] and size + nbytes > max_shard_bytes:
                shards.append({})
                size = 0
            shards[-1][published.stored_name(model.cfg, name)] = t
            size += nbytes
        weight_map = {}
        for i, shard in enumerate(shards):
            fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, str(tmp / fname), metadata={"format": "pt"})
            weight_map.update({k: fname for k in shard})
        total = sum(t.numel() * t.element_size() for s in shards for t in s.values())
        (tmp / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
        shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
        block = published.quantization_config(shapes) if published.holds_packed(weight_map) else None
        config = config_to_hf(model.cfg, dtype=model.lm_head.weight.dtype, quantization=block)
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        for name, data in (extra_files or {}).items():
            (tmp / name).write_bytes(data)
        for f in [tmp, *tmp.iterdir()]:  # mkdtemp creates 0700, safetensors writes 0600: for everyone to read
            normal_permissions(f)
        if path.exists():
            path.rmdir()
        os.replace(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path
