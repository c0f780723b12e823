"""A checkpoint's identity — the files its weights come from (`used_files`) and their digests
(`checkpoint_hash`, recorded by every export from a checkpoint) — and a checkpoint referenced by an export
instead of copied into it (`k3x export --weights reference`).

The export folder then holds graphs only; the manifest's `weight_source` entry names the checkpoint:

    {"kind": "checkpoint", "path": <as given>, "resolved": <absolute, links followed>,
     "files": [{"name": "config.json", "bytes": N, "sha256": "..."}, ...],   # every file the weights come from
     "prefix": "lm."}   # only when the programs name the weights with a prefix (a serving step: exporter/serving.py)

A runner loads the weights from there tensor by tensor (`referenced_tensors`, the names and dtypes a copying
export writes) from exactly the recorded files, each opened once, checked (present in the folder, not a link
leaving it (fileio.confined), a regular file of the recorded size and, unless the hash check is skipped,
sha256) and loaded from the same open file (checkpoint/recorded.py); else one line naming the file.
`referenced_checkpoint` checks the files by path (an engine build, the refit's ranges).
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Iterator

import torch

from ..fileio import sha256
from .files import INDEX, CheckpointError, checkpoint_file, tensor_files
from .recorded import recorded_tensors

KIND = "checkpoint"


def used_files(path: Path) -> list[Path]:
    """The files the weights come from, in name order: config.json, the index when present, every shard used
    (each a bare name in `path`, links leaving it refused)."""
    used = {checkpoint_file(path, "config.json"), *set(tensor_files(path).values())}
    if checkpoint_file(path, INDEX).is_file():
        used.add(path / INDEX)
    return sorted(used)


def checkpoint_hash(path: str | Path) -> str:
    """sha256 over exactly the files the weights come from: config.json, the index when present, and every
    shard it (or the folder, without an index) uses — streamed, in name order. Shards outside the folder are
    refused (CheckpointError), never silently left out."""
    return checkpoint_digests(path)[0]


def checkpoint_digests(path: str | Path) -> tuple[str, dict[Path, str]]:
    """(`checkpoint_hash`, each used file's own sha256), every file read once."""
    path = Path(path)
    h, each = hashlib.sha256(), {}
    for f in used_files(path):
        h.update(str(f.relative_to(path)).encode())
        one = hashlib.sha256()
        with open(f, "rb") as src:
            for chunk in iter(lambda: src.read(1 << 20), b""):
                h.update(chunk)
                one.update(chunk)
        each[f] = one.hexdigest()
    return h.hexdigest()[:16], each


def reference_entry(path: str | Path) -> tuple[dict, str]:
    """(the manifest's `weight_source` entry for checkpoint `path`, its `checkpoint_hash`): each used file
    read once."""
    path = Path(path)
    digest, each = checkpoint_digests(path)
    files = [{"name": f.name, "bytes": f.stat().st_size, "sha256": sha} for f, sha in each.items()]
    return {"kind": KIND, "path": str(path), "resolved": str(path.resolve()), "files": files}, digest


def referenced_checkpoint(entry: dict, *, check_hash: bool = True) -> Path:
    """The checkpoint folder `entry` references, once every recorded file is there unchanged (size, and
    sha256 unless `check_hash` is off). CheckpointError (one line naming the file) otherwise."""
    if not isinstance(entry, dict) or entry.get("kind") != KIND or not isinstance(entry.get("files"), list):
        raise CheckpointError(f"weight_source {str(entry)[:80]!r}: not a checkpoint reference")
    folder = Path(str(entry.get("resolved")))
    if not folder.is_dir():
        raise CheckpointError(f"{folder}: the referenced checkpoint is missing (moved or deleted since the "
                              "export); re-export, or put it back")
    for f in entry["files"]:
        p = checkpoint_file(folder, f.get("name"))
        if not p.is_file():
            raise CheckpointError(f"{p}: missing from the referenced checkpoint; refused")
        if p.stat().st_size != f.get("bytes"):
            raise CheckpointError(f"{p}: {p.stat().st_size} bytes, the export recorded {f.get('bytes')}: "
                                  "the checkpoint changed since the export; refused")
        if check_hash and sha256(p) != f.get("sha256"):
            raise CheckpointError(f"{p}: sha256 differs from the export's record: the checkpoint changed since "
                                  "the export; refused")
    return folder


def referenced_tensors(entry: dict, *, dtype: torch.dtype, expert_format: str, check_hash: bool = True
                       ) -> Iterator[tuple[str, torch.Tensor]]:
    """The weights of the checkpoint a manifest's `weight_source` `entry` references, as a copying export
    writes them (the entry's `prefix` + state_dict name, packed MXFP4 as stored), one tensor at a time, read
    from the recorded files only (checkpoint/recorded.py)."""
    prefix = str(entry.get("prefix", "")) if isinstance(entry, dict) else ""
    for name, t in recorded_tensors(entry, dtype=dtype, expert_format=expert_format, check_hash=check_hash):
        yield prefix + name, t
