"""Weights streamed into a `.pt2`: a program traced on meta plus the checkpoint's tensors, written tensor by
tensor into the archive `torch.export.save` would write, never holding the model.

torch 2.13's archive (torch/export/pt2_archive/_package.py) is an uncompressed zip (records 64-byte aligned)
under `archive/`: `models/model.json` (the graph), `data/weights/model_weights_config.json` (per weight FQN: a
record `weight_N` and its tensor meta), one raw-bytes record `data/weights/weight_N` per storage, constants,
sample inputs and version records. `save_streamed_pt2`:

1. saves the meta program (sample inputs as cpu zeros) into memory with `torch.export.save` (or the fast
   save of a stamped program, exporter/stamp_save.py: the same archive): graph and
   metadata, zero-length weight records; every device in the serialized graph and weights config is then
   made cpu (`cpu_devices`, the serialized form of `trace.with_weights`'s `move_to_device_pass`);
2. writes the final zip: each weight gets its own record `weight_N` filled from the stream — a
   `StoredTensor` (bytes as stored in the checkpoint) is copied file to file (`checkpoint_ranges.copy_ranges`,
   the CRC-32 computed with `pread` chunks, nothing mapped), a converted tensor is written from memory — then
   every other skeleton record is copied, and the weights config is rewritten to name the new records.
Peak memory: the skeleton, one converted tensor (or a 16 MiB chunk) at a time. `torch.export.load` reads the
result like any saved program; the names/shapes/dtypes are checked against the traced program first.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import struct
import time
import zipfile
import zlib
from pathlib import Path
from typing import BinaryIO, Callable, Iterable, Iterator

import torch
from torch.export import ExportedProgram

from ..checkpoint.byte_ranges import StoredTensor, WriteLog, copy_ranges, require_all, wrong_entry

ROOT = "archive/"
WEIGHTS_CONFIG = "archive/data/weights/model_weights_config.json"
WEIGHT_RECORD = "archive/data/weights/"
MODELS = "archive/models/"
ALIGN = 64  # torch's PyTorchFileWriter alignment of record data
_MARK = 0xFFFFFFFF  # a 32-bit field whose value is in the zip64 extra field
ZIP64_FROM = 0xFFFFFFFF  # sizes / offsets from here on go to zip64 fields (a test lowers it)


def _m(v: int) -> int:
    return _MARK if v >= ZIP64_FROM else v


def skeleton(ep: ExportedProgram) -> ExportedProgram:
    """`ep` (traced on meta) sharing its graph, with cpu zeros as sample inputs; nothing allocated but those."""
    examples = None if ep.example_inputs is None else torch.utils._pytree.tree_map_only(
        torch.Tensor, lambda x: torch.zeros(x.shape, dtype=x.dtype), ep.example_inputs)
    return ExportedProgram(root=ep.graph_module, graph=ep.graph, graph_signature=ep.graph_signature,
                           state_dict=ep.state_dict, range_constraints=ep.range_constraints,
                           module_call_graph=ep.module_call_graph, example_inputs=examples, constants=ep.constants,
                           verifiers=ep.verifiers)


def cpu_devices(obj: object) -> object:
    """A serialized program (models/*.json, the weights config) with every device `{"type": "meta", "index": i}`
    made cpu: what `move_to_device_pass(ep, {"meta": "cpu"})` gives, without running fake-tensor `.to` on
    every node (18 s on a 0.3 GB model, minutes on K3)."""
    if isinstance(obj, dict):
        if obj.keys() == {"type", "index"} and obj["type"] == "meta":
            return {"type": "cpu", "index": None}
        return {k: cpu_devices(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [cpu_devices(v) for v in obj]
    return obj


class _ZipWriter:
    """Stored (uncompressed) zip records, data 64-byte aligned, zip64 where sizes or offsets need it, written
    strictly in order so the file's sha256 is taken as it is written (`digest`). A copied record's CRC-32 is
    known only after its bytes went by: it is flagged "data descriptor" (general-purpose bit 3) and its CRC and
    sizes follow the data (and sit in the central directory), so the source is read once, by `pread` chunks
    that feed CRC and sha256, each chunk then copied file to file (already in the page cache)."""

    def __init__(self, f: BinaryIO) -> None:
        self.f, self.central, self.sha = f, [], hashlib.sha256()

    def _write(self, data: bytes | memoryview) -> None:
        self.f.write(data)
        self.sha.update(data)

    def _local(self, name: str, size: int, crc: int, descriptor: bool) -> None:
        raw = name.encode()
        offset = self.f.tell()
        zip64 = size >= ZIP64_FROM
        known = 0 if descriptor else size
        extra64 = struct.pack("<HHQQ", 1, 16, known, known) if zip64 else b""
        pad = -(offset + 30 + len(raw) + len(extra64) + 4) % ALIGN
        extra = extra64 + struct.pack("<HH", 0x4246, pad) + b"Z" * pad  # "FB": torch's padding field
        small = _MARK if zip64 else known
        self._write(struct.pack("<IHHHHHIIIHH", 0x04034B50, 45 if zip64 else 20, 8 if descriptor else 0, 0, 0, 0x21,
                                0 if descriptor else crc, small, small, len(raw), len(extra)) + raw + extra)
        self.central.append([raw, size, crc, offset, 8 if descriptor else 0])

    def add_bytes(self, name: str, data: bytes | memoryview) -> None:
        data = memoryview(data).cast("B")
        self._local(name, data.nbytes, zlib.crc32(data), descriptor=False)
        self._write(data)

    def add_stored(self, name: str, t: StoredTensor) -> None:
        self._local(name, t.nbytes, 0, descriptor=True)
        crc = 0

        def checksum(chunk: bytes) -> None:
            nonlocal crc
            crc = zlib.crc32(chunk, crc)

        copy_ranges(t.ranges, self.f, see=(checksum, self.sha.update))
        self.central[-1][2] = crc
        size = "Q" if t.nbytes >= ZIP64_FROM else "I"
        self._write(struct.pack(f"<II{size}{size}", 0x08074B50, crc, t.nbytes, t.nbytes))

    def close(self) -> str:
        """Central directory and end records; returns the file's sha256 (hex)."""
        start = self.f.tell()
        for raw, size, crc, offset, flags in self.central:
            fields = [v for v in (size, size, offset) if v >= ZIP64_FROM]
            extra = struct.pack("<HH", 1, 8 * len(fields)) + struct.pack(f"<{len(fields)}Q", *fields) if fields else b""
            self._write(struct.pack("<IHHHHHHIIIHHHHHII", 0x02014B50, 45, 45 if extra else 20, flags, 0, 0, 0x21, crc,
                                    _m(size), _m(size), len(raw), len(extra), 0, 0, 0, 0, _m(offset)) + raw + extra)
        end, n = self.f.tell(), len(self.central)
        self._write(struct.pack("<IQHHIIQQQQ", 0x06064B50, 44, 45, 45, 0, 0, n, n, end - start, start))
        self._write(struct.pack("<IIQI", 0x07064B50, 0, end, 1))
        self._write(struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, min(n, 0xFFFF), min(n, 0xFFFF),
                                min(end - start, _MARK), min(start, _MARK), 0))
        return self.sha.hexdigest()


@contextlib.contextmanager
def _naming(path: str | Path) -> Iterator[None]:
    """A failed write (full disk) is an OSError naming the archive."""
    try:
        yield
    except OSError as e:
        if e.filename is None and e.errno is not None and str(path) not in str(e):
            raise OSError(e.errno, f"{path}: {e.strerror}") from None
        raise


def save_streamed_pt2(ep: ExportedProgram, path: str | Path, weights: Iterable[tuple[str, torch.Tensor | StoredTensor]],
                      *, save: Callable[..., object] | None = None) -> str:
    """Write `ep` (traced on meta) to `path` as a `.pt2` whose weights come from `weights`, one at a time;
    returns the file's sha256 (taken as it was written). `save`: what writes the skeleton (default
    `torch.export.save`; exporter/stamp_save.py's for a stamped program).
    ValueError naming the tensor on a dtype/shape mismatch or naming the weights the stream did not give."""
    buf = io.BytesIO()
    (save or torch.export.save)(skeleton(ep), buf)
    want = {k: (v.dtype, tuple(v.shape)) for k, v in ep.state_dict.items()}
    with zipfile.ZipFile(buf) as skel:
        config = json.loads(skel.read(WEIGHTS_CONFIG))
        others = [i for i in skel.infolist() if i.filename != WEIGHTS_CONFIG
                  and not (i.filename.startswith(WEIGHT_RECORD) and i.filename.rsplit("/", 1)[1].startswith("weight_"))]
        done: set[str] = set()
        log, start = WriteLog(), time.perf_counter()
        with open(path, "wb") as f, _naming(path):
            z = _ZipWriter(f)
            for name, t in weights:
                if name not in want:
                    continue  # a state_dict entry the program does not read
                if (t.dtype, tuple(t.shape)) != want[name]:
                    raise wrong_entry(name, t, f"the program wants {want[name][0]} {list(want[name][1])}")
                record = f"weight_{len(done)}"
                if isinstance(t, StoredTensor):
                    z.add_stored(WEIGHT_RECORD + record, t)
                    log.copied += t.nbytes
                else:
                    z.add_bytes(WEIGHT_RECORD + record, t.detach().contiguous().view(torch.uint8).numpy())
                    log.converted += t.nbytes
                config["config"][name]["path_name"] = record
                done.add(name)
                del t
            log.seconds = time.perf_counter() - start
            log.report(Path(path).name)
            require_all(set(want) - done)
            z.add_bytes(WEIGHTS_CONFIG, json.dumps(cpu_devices(config)).encode())
            for info in others:
                data = skel.read(info)
                if info.filename.startswith(MODELS) and info.filename.endswith(".json"):
                    data = json.dumps(cpu_devices(json.loads(data))).encode()
                z.add_bytes(info.filename, data)
            return z.close()
