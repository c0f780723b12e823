"""A checkpoint's tensors as byte ranges: what an exporter copies file to file instead of through memory.

`stream_weights` yields the model's state_dict one entry at a time, like `checkpoint.stream_tensors`, but
where the model tensor's bytes ARE the checkpoint's bytes (same dtype, no decoding or trimming: bf16 -> bf16,
packed MXFP4 uint8 -> uint8) the entry is a `StoredTensor`: the (shard file, offset, length) ranges that,
concatenated, are the tensor's bytes (one range, or one per expert of a stacked expert tensor). A writer
copies them with `copy_ranges` (`os.copy_file_range`: the kernel copies page cache to page cache; the writer's
CRC / sha256 see the bytes in 16 MiB `pread` chunks on worker threads; `A_log`, stored longer than the head
count, is the prefix of its stored bytes). Any other entry (a dtype conversion, dense-decoded experts) is a
filled `torch.Tensor` as before.

Notable choices:
- Offsets come from the safetensors header (8-byte little-endian length + JSON, data after it), read once
  per shard; `files.validate` has already checked every name, shape and dtype.
- The E8M0 scale check of `load_checkpoint` (0xFF is NaN, refused) still runs on copied scales: they are read
  with `pread` (1/16 of the packed bytes), never mapped, so nothing of the shards stays resident.
"""

from __future__ import annotations

import errno
import json
import os
import struct
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Callable, Iterator

import numpy as np
import torch

from ..plan.kernels import Kernels
from .files import CheckpointError, open_checkpoint, read_into, stored_pieces

# safetensors dtype names whose bytes a model tensor of this torch dtype holds unchanged
_SAFETENSORS = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "U8": torch.uint8}
CHUNK = 16 << 20  # pread / copy granularity
AHEAD = 4  # chunks read but not yet seen by `see` (64 MiB)


@dataclass(frozen=True)
class ByteRange:
    file: Path
    offset: int  # absolute, in bytes from the start of the file
    nbytes: int


@dataclass(frozen=True)
class StoredTensor:
    """A model tensor whose bytes are `ranges` of the checkpoint's files, in order."""
    dtype: torch.dtype
    shape: tuple[int, ...]
    ranges: tuple[ByteRange, ...]

    @property
    def nbytes(self) -> int:
        return sum(r.nbytes for r in self.ranges)


def _header(f: Path) -> dict[str, tuple[str, int, int]]:
    """safetensors header: tensor -> (dtype, absolute offset, nbytes)."""
    with open(f, "rb") as h:
        (n,) = struct.unpack("<Q", h.read(8))
        meta = json.loads(h.read(n))
    return {k: (v["dtype"], 8 + n + v["data_offsets"][0], v["data_offsets"][1] - v["data_offsets"][0])
            for k, v in meta.items() if k != "__metadata__"}


def _ranges(target: torch.Tensor, pieces: list, headers: dict[Path, dict]) -> tuple[ByteRange, ...] | None:
    """The byte ranges that make `target` (a meta tensor), or None when its bytes need converting."""
    out: list[tuple[int, ByteRange]] = []
    for s, stored, f, _ in pieces:
        if f not in headers:
            headers[f] = _header(f)
        dtype, offset, nbytes = headers[f][stored]
        if _SAFETENSORS.get(dtype) != target.dtype:
            return None
        if s.param.endswith("A_log"):  # stored longer than the head count: the model keeps its first values
            nbytes = min(nbytes, target.numel() * target.element_size())
        out.append((-1 if s.expert is None else s.expert, ByteRange(f, offset, nbytes)))
    out.sort(key=lambda x: x[0])
    rows = [e for e, _ in out]
    if rows not in ([-1], list(range(target.shape[0]))):
        return None
    ranges = tuple(r for _, r in out)
    if sum(r.nbytes for r in ranges) != target.numel() * target.element_size():
        return None
    return ranges


def _check_scales(name: str, ranges: tuple[ByteRange, ...]) -> None:
    for r in ranges:
        with open(r.file, "rb") as h:
            for start in range(0, r.nbytes, CHUNK):
                b = os.pread(h.fileno(), min(CHUNK, r.nbytes - start), r.offset + start)
                if (np.frombuffer(b, np.uint8) == 0xFF).any():
                    raise CheckpointError(f"{name} in {r.file.name}: mxfp4: weight_scale holds 0xFF, "
                                          "the E8M0 NaN encoding")


def stream_weights(path: str | Path, *, dtype: torch.dtype = torch.float32, expert_format: str | None = None,
                   opened: tuple | None = None, dtypes: dict[str, torch.dtype] | None = None
                   ) -> Iterator[tuple[str, torch.Tensor | StoredTensor]]:
    """The model's state_dict in order: a `StoredTensor` where the bytes can be copied as stored, else a filled
    tensor (at most one alive at a time). Validation happens before the first entry. `opened`: the checkpoint
    already opened (checkpoint/recorded.recorded_checkpoint: its headers are served from there). `dtypes`:
    entries given in another dtype than `dtype` (a bf16 trunk's projections, exporter/trunk_weights.py)."""
    cfg, plan, handles, meta = opened or open_checkpoint(Path(path), dtype, Kernels.REFERENCE, expert_format)
    state = meta.state_dict()
    pieces = stored_pieces(plan, dict(meta.named_parameters()) | dict(meta.named_buffers()))
    headers: dict[Path, dict] = {} if opened is None else {f: h.header() for f, h in handles.items()}

    def entries() -> Iterator[tuple[str, torch.Tensor | StoredTensor]]:
        with torch.no_grad():
            for name, m in state.items():
                if dtypes and name in dtypes:
                    m = torch.empty(m.shape, dtype=dtypes[name], device="meta")
                ranges = _ranges(m, pieces[name], headers)
                if ranges is not None:
                    if name.endswith("_scale") and m.dtype == torch.uint8:
                        _check_scales(name, ranges)
                    yield name, StoredTensor(m.dtype, tuple(m.shape), ranges)
                    continue
                t = torch.empty(m.shape, dtype=m.dtype)
                read_into(t, pieces[name], plan, handles, unmap_every=256 << 20)
                handles.clear()  # mapped shard pages count as resident: unmap what this tensor read
                yield name, t
                del t

    return entries()


def wrong_entry(name: str, t: torch.Tensor | StoredTensor, wants: str) -> ValueError:
    """The error of a weights writer given an entry of another dtype/shape than its artifact declares."""
    return ValueError(f"weight {name!r}: checkpoint gives {t.dtype} {list(t.shape)}, {wants}")


def require_all(missing: set[str]) -> None:
    """ValueError naming (up to five of) the weights a writer's artifact declares but the stream did not give."""
    if missing:
        names = sorted(missing)
        raise ValueError(f"weights not in the checkpoint stream: {names[:5]}{' ...' if len(names) > 5 else ''}")


@dataclass
class WriteLog:
    """What a weights writer wrote: bytes copied file to file, bytes converted in memory, seconds; logged
    (logger `k3x.weights`, INFO) when the writer finishes so a benchmark can split the stage time."""
    copied: int = 0
    converted: int = 0
    seconds: float = 0.0

    def report(self, artifact: str) -> None:
        import logging

        logging.getLogger("k3x.weights").info("weights written %s: copied %d B, converted %d B, %.3f s",
                                              artifact, self.copied, self.converted, self.seconds)


def copy_ranges(ranges: tuple[ByteRange, ...], out: BinaryIO, *, see: tuple[Callable[[bytes], None], ...] = ()
                ) -> None:
    """Append the ranges' bytes to `out` at its current position, file to file (`os.copy_file_range`; a
    plain `pread`/`write` loop where the kernel or filesystem refuses). `see`: functions called with every
    chunk, in order, read with `pread` just before it is copied (checksums or digests of the bytes; the copy
    then finds them in the page cache), each on its own worker thread so the hashes run side by side and
    overlap the copy and the next read (hashlib and zlib release the GIL); every call has returned when
    this returns. The chunks ahead are `WILLNEED`-advised while one is handled, so the reads queue on the
    disk instead of waiting one by one."""
    out.flush()
    fd, pos = out.fileno(), out.tell()
    # every chunk of every range, in order; the read-ahead crosses ranges and files (an expert is one chunk)
    chunks = [(r.file, r.offset + d, min(CHUNK, r.nbytes - d)) for r in ranges for d in range(0, r.nbytes, CHUNK)]
    seers = [ThreadPoolExecutor(max_workers=1) for _ in see]  # one worker per function: chunks in order
    files: dict[Path, int] = {}
    try:
        pending: deque = deque()
        for i, (name, at, n) in enumerate(chunks):
            window = chunks[1: 1 + AHEAD] if i == 0 else chunks[i + AHEAD: i + AHEAD + 1]  # each advised once
            for ahead_name, ahead_at, ahead_n in window:
                os.posix_fadvise(_fd(files, ahead_name), ahead_at, ahead_n, os.POSIX_FADV_WILLNEED)
            src = _fd(files, name)
            if see:
                chunk = os.pread(src, n, at)
                if len(chunk) != n:
                    raise OSError(f"{name}: short read at byte {at} (file truncated?)")
                pending.append([w.submit(fn, chunk) for w, fn in zip(seers, see)])
                while len(pending) > AHEAD:
                    [f.result() for f in pending.popleft()]
            _copy(src, fd, n, at, pos, name)
            pos += n
        while pending:
            [f.result() for f in pending.popleft()]
    finally:
        for w in seers:
            w.shutdown()
        for f in files.values():
            os.close(f)
    out.seek(pos)


def _fd(files: dict[Path, int], name: Path) -> int:
    if name not in files:
        files[name] = os.open(name, os.O_RDONLY)
    return files[name]


def _copy(src: int, dst: int, n: int, at: int, pos: int, name: Path) -> None:
    copied = 0
    while copied < n:
        try:
            got = os.copy_file_range(src, dst, n - copied, at + copied, pos + copied)
        except OSError as e:  # not between these files (another filesystem, old kernel): via memory
            if e.errno not in (errno.EXDEV, errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
                raise
            got = os.pwrite(dst, os.pread(src, n - copied, at + copied), pos + copied)
        if got <= 0:
            raise OSError(f"{name}: short read at byte {at + copied} (file truncated?)")
        copied += got
