"""A referenced checkpoint read exactly as the export recorded it (`k3x export --weights reference`).

The manifest's `weight_source` lists every file the weights come from (checkpoint/reference.py: config.json,
the index when there was one, the shards in use), each with its size and sha256. `recorded_tensors` opens
each of those files once, by its recorded name (fileio.confined: inside the folder, links leaving it
refused), without blocking, and only when it is a regular file of the recorded size; it maps that open file,
hashes the mapping (unless the hash check is off) and serves everything the loader reads from the mappings:
config.json, the index, every safetensors header and tensor (`MappedShard`, the part of a `safe_open` handle
the loader uses, its header checked: dtypes, shapes, offsets inside the file). So:
- nothing else is opened: an index or a shard added to the folder after the export is never read (an index
  the export recorded that names a shard it did not record is refused), a FIFO among the files is never
  waited on;
- the bytes loaded are the bytes hashed: a file renamed over a recorded one after the check is not seen (the
  mapping holds the file that was opened), and one written in place while it is read (its size or mtime
  differ once every tensor is read) is refused, as `.pt2` loading does (folder/trust.checked_pt2).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import mmap
import os
import stat
import struct
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch

from ..model.init import build_model
from ..plan.kernels import Kernels
from .files import (INDEX, CheckpointError, Shards, checkpoint_config, checkpoint_file, header_files, index_files,
                    tensors_of, validate, weight_map)

_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool}
_MAX_HEADER = 100 << 20  # the safetensors format's own limit on a header


class _Slice:
    def __init__(self, dtype: str, shape: list[int]) -> None:
        self.dtype, self.shape = dtype, shape

    def get_shape(self) -> list[int]:
        return list(self.shape)

    def get_dtype(self) -> str:
        return self.dtype


class MappedShard:
    """A safetensors file served from the mapping of the file that was hashed: `keys`, `get_slice` (shape,
    dtype) and `get_tensor` (a copy of its bytes), as a `safe_open` handle gives them."""

    def __init__(self, path: Path, data: mmap.mmap | bytes) -> None:
        self.path, self.data = path, data
        try:
            (n,) = struct.unpack_from("<Q", data)
            if n > min(_MAX_HEADER, len(data) - 8):
                raise ValueError(f"header length {n} passes the file's end")
            header = json.loads(bytes(data[8:8 + n]).decode("utf-8"))
            if not isinstance(header, dict):
                raise ValueError("the header is not a JSON object")
            self.entries = {k: self._entry(k, v, 8 + n) for k, v in header.items() if k != "__metadata__"}
        except (ValueError, TypeError, KeyError, struct.error, RecursionError) as e:
            raise CheckpointError(f"{path}: not a readable safetensors file ({str(e)[:200]})") from None

    def _entry(self, name: str, v: Any, base: int) -> tuple[str, list[int], int, int]:
        dtype, shape, (start, end) = v["dtype"], v["shape"], v["data_offsets"]
        if dtype not in _DTYPES:
            raise ValueError(f"{name}: dtype {str(dtype)[:20]!r} is not one k3x reads")
        if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
            raise ValueError(f"{name}: shape {str(shape)[:60]} is not a list of sizes")
        if not (isinstance(start, int) and isinstance(end, int) and 0 <= start <= end <= len(self.data) - base):
            raise ValueError(f"{name}: data_offsets {str(v['data_offsets'])[:60]} are not inside the file")
        if end - start != math.prod(shape) * _DTYPES[dtype].itemsize:
            raise ValueError(f"{name}: {end - start} bytes for {dtype} {shape}")
        return dtype, shape, base + start, end - start

    def keys(self) -> list[str]:
        return list(self.entries)

    def get_slice(self, name: str) -> _Slice:
        dtype, shape, _, _ = self.entries[name]
        return _Slice(dtype, shape)

    def get_tensor(self, name: str) -> torch.Tensor:
        dtype, shape, at, n = self.entries[name]
        out = torch.empty(n, dtype=torch.uint8)
        if n:
            out.numpy()[:] = np.frombuffer(self.data, np.uint8, n, at)
        return out.view(_DTYPES[dtype]).reshape(shape)

    def header(self) -> dict[str, tuple[str, int, int]]:
        """tensor -> (dtype, absolute offset, nbytes), as checkpoint/byte_ranges reads a header."""
        return {k: (dtype, at, n) for k, (dtype, _, at, n) in self.entries.items()}

    def release(self) -> None:
        """Drop the pages read so far from this process's resident memory (they are read again if needed)."""
        if isinstance(self.data, mmap.mmap) and len(self.data):
            self.data.madvise(mmap.MADV_DONTNEED)


class RecordedShards(Shards):
    """The recorded shards by path; any other file is refused, never opened. `clear` (the loader unmapping
    what one tensor read) releases the pages and keeps the mappings."""

    def __missing__(self, f: Path):
        raise CheckpointError(f"{f}: not one of the files the export recorded; not read")

    def clear(self) -> None:
        for shard in self.values():
            shard.release()


def _stamp(st: os.stat_result) -> tuple[int, int, int]:
    return st.st_ino, st.st_size, st.st_mtime_ns


def _open(folder: Path, record: Any, check_hash: bool, stack: contextlib.ExitStack) -> tuple[Path, Any, int, tuple]:
    """(path, its mapping, fd, stamp) of one recorded file: a regular file of the recorded size (and sha256)."""
    if not isinstance(record, dict) or not isinstance(record.get("bytes"), int):
        raise CheckpointError(f"weight_source file {str(record)[:80]!r}: not {{name, bytes, sha256}}")
    path = checkpoint_file(folder, record.get("name"))
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing from the referenced checkpoint; refused") from None
    except OSError as e:
        raise CheckpointError(f"{path}: cannot open it ({e.strerror})") from None
    stack.callback(os.close, fd)
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise CheckpointError(f"{path}: not a regular file; refused")
    if st.st_size != record["bytes"]:
        raise CheckpointError(f"{path}: {st.st_size} bytes, the export recorded {record['bytes']}: the checkpoint "
                              "changed since the export; refused")
    data = b"" if not st.st_size else stack.enter_context(mmap.mmap(fd, st.st_size, access=mmap.ACCESS_READ))
    if check_hash and hashlib.sha256(data).hexdigest() != record.get("sha256"):
        raise CheckpointError(f"{path}: sha256 differs from the export's record (hashed from the file that is then "
                              "loaded): the checkpoint changed since the export; refused")
    return path, data, fd, _stamp(st)


def recorded_tensors(entry: dict, *, dtype: torch.dtype, expert_format: str | None, check_hash: bool = True
                     ) -> Iterator[tuple[str, torch.Tensor]]:
    """The model's state_dict, one tensor at a time (`files.stream_tensors`' names, dtypes and packing), read
    from the recorded files of the checkpoint `entry` (a manifest's `weight_source`) as the module docstring
    says. CheckpointError (one line naming the file) for a missing, changed or unrecorded file; every file is
    opened, checked and validated before the first tensor."""
    with recorded_checkpoint(entry, dtype=dtype, expert_format=expert_format, check_hash=check_hash) as opened:
        yield from tensors_of(*opened)


@contextlib.contextmanager
def recorded_checkpoint(entry: dict, *, dtype: torch.dtype, expert_format: str | None, check_hash: bool = True
                        ) -> Iterator[tuple[Any, dict, RecordedShards, torch.nn.Module]]:
    """(config, validated plan, shard handles, meta model) of the checkpoint `entry` references, as
    `files.open_checkpoint` gives them, served from the recorded files (`recorded_tensors`); on leaving, a
    file written to while it was open is refused."""
    if not isinstance(entry, dict) or not isinstance(entry.get("files"), list):
        raise CheckpointError(f"weight_source {str(entry)[:80]!r}: not a checkpoint reference")
    folder = Path(str(entry.get("resolved")))
    if not folder.is_dir():
        raise CheckpointError(f"{folder}: the referenced checkpoint is missing (moved or deleted since the "
                              "export); re-export, or put it back")
    with contextlib.ExitStack() as stack:
        opened = {path.name: (path, data, fd, stamp)
                  for path, data, fd, stamp in (_open(folder, r, check_hash, stack) for r in entry["files"])}
        if "config.json" not in opened:
            raise CheckpointError(f"{folder}: the export recorded no config.json of the checkpoint")
        shards = RecordedShards({path: MappedShard(path, data) for name, (path, data, _, _) in opened.items()
                                 if name.endswith(".safetensors")})
        if INDEX in opened:
            names = weight_map(folder, bytes(opened[INDEX][1]))
            unrecorded = sorted({str(f)[:80] for f in names.values() if f not in opened})
            if unrecorded:
                raise CheckpointError(f"{folder / INDEX}: names {unrecorded[0]!r}, a file the export did not "
                                      "record; refused")
            files = index_files(folder, names, shards)
        else:
            files = header_files(folder, sorted(shards), shards)
        cfg, build = checkpoint_config(folder, expert_format, files, Kernels.REFERENCE,
                                       config=bytes(opened["config.json"][1]))
        plan = validate(cfg, build, files, shards)
        yield cfg, plan, shards, build_model(cfg, build, device="meta", dtype=dtype, seed=None)
        for path, _, fd, stamp in opened.values():
            if _stamp(os.fstat(fd)) != stamp:
                raise CheckpointError(f"{path}: changed while it was being loaded; refused")
