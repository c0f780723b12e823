"""The floating dtype a checkpoint stores its model in, for `--dtype auto` (exporter/presets.model_dtype).

Notable choices:
- config.json's `torch_dtype` (or `dtype`, the transformers-5 name; either at the top level or in `text_config`)
  decides, as Hugging Face's own loaders read it; a value that is not a string naming a float dtype is refused
  in one line naming the field.
- Without it, the safetensors headers decide: the float dtype holding most of the bytes (MXFP4 experts'
  packed bytes and scales, integer tensors, are not model floats and do not count). Only headers are read.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from .files import CheckpointError, Shards, checkpoint_file, tensor_files

# config.json spellings (torch's names, with or without "torch.") and safetensors' header codes
CONFIG_NAMES = {"bfloat16": "bfloat16", "float32": "float32", "float": "float32", "float16": "float16",
                "half": "float16"}
HEADER_NAMES = {"BF16": "bfloat16", "F32": "float32", "F16": "float16", "F64": "float64"}
HEADER_BYTES = {"BF16": 2, "F32": 4, "F16": 2, "F64": 8}


def _config_dtype(path: Path) -> tuple[str, str] | None:
    """(dtype, "config.json torch_dtype") when config.json names one."""
    f = checkpoint_file(path, "config.json")
    try:
        raw = json.loads(f.read_bytes().decode("utf-8"))
    except (OSError, ValueError, RecursionError) as e:
        raise CheckpointError(f"{f}: unreadable ({str(e)[:200]})") from None
    for where, d in (("", raw), ("text_config.", raw.get("text_config") if isinstance(raw, dict) else None)):
        if not isinstance(d, dict):
            continue
        for key in ("torch_dtype", "dtype"):
            if key not in d or d[key] is None:
                continue
            v = d[key]
            name = CONFIG_NAMES.get(v.removeprefix("torch.")) if isinstance(v, str) else None
            if name is None:
                raise CheckpointError(f"{f}: {where}{key}={str(v)[:80]!r}: expected one of "
                                      f"{', '.join(sorted(set(CONFIG_NAMES.values())))}; or pass --dtype")
            return name, f"config.json {where}{key} {v}"
    return None


def _header_dtype(path: Path) -> tuple[str, str]:
    """(dtype, why) from the safetensors headers: the float dtype holding most bytes."""
    shards = Shards()
    by_dtype: dict[str, int] = {}
    for name, f in tensor_files(path, shards).items():
        sl = shards[f].get_slice(name)
        code = sl.get_dtype()
        if code in HEADER_BYTES:
            by_dtype[code] = by_dtype.get(code, 0) + HEADER_BYTES[code] * math.prod(sl.get_shape())
    if not by_dtype:
        raise CheckpointError(f"{path}: no floating-point tensor in its safetensors files; pass --dtype")
    code = max(by_dtype, key=by_dtype.__getitem__)
    return HEADER_NAMES[code], f"the safetensors store {HEADER_NAMES[code]}"


def stored_dtype(path: str | Path) -> tuple[str, str]:
    """(torch dtype name: bfloat16 | float32 | float16 | float64, where it was read) of the checkpoint in `path`."""
    path = Path(path)
    return _config_dtype(path) or _header_dtype(path)
