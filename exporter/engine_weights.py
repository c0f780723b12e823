"""Where each weight of a weight-stripped engine comes from (`k3x build-engine --strip-weights`).

A stripped plan (TensorRT's `STRIP_PLAN` with `REFIT_IDENTICAL`: the engine is refitted with the very weights it
was built from, so TensorRT keeps the optimisations of a constant-weight build) holds none of its refittable
weights; the runner refits them at load (runtime/engine_refit.py). `weight_sources` makes the table it reads:
one entry per initializer of `model.trt.onnx` (every weight TensorRT can ask for by name), naming

- an external initializer: the data file (`model.onnx.data`, the export's, already hash-checked as part of the
  `onnx` artifact), its byte `offset` and `length`;
- an inline one (ONNX keeps tensors under 1 KiB in the graph): `"file": "model.trt.onnx"` with `"inline": true`
  (read from the graph proto, which holds only such small tensors);

- a weight of an export that references its checkpoint (`k3x export --weights reference`: the initializer points
  at the absent `REFERENCE_LOCATION`): `"checkpoint": true` and its `ranges` in the checkpoint's safetensors
  shards (`[{file, offset, length}]`, file a bare name in the checkpoint folder the manifest's `weight_source`
  names; one range per expert of a stacked expert tensor, MXFP4 bytes as stored, `checkpoint_ranges`), `length`
  their total. A weight the checkpoint does not store as the program holds it (another dtype, dense-decoded
  experts) has no range: refused, naming it;

with the ONNX `dtype` (its TensorProto name: FLOAT, BFLOAT16, UINT8, ...), `shape` and the bytes' `sha256`,
which the runner checks as it streams each weight.
An export whose weights are all inline (`external_data` unset: under 2 GB, written without it) is refused:
its plan would be refitted from a copy of the whole graph in memory, which is what stripping avoids.

The table is read back from `model.engine.json`, a file of the folder, so the refit trusts it no more than an
artifact: `check_sources` checks its schema and resolves every source before a byte is read (a file source
inside the export folder, fileio's confinement rule; a checkpoint range in one of the files the manifest's
`weight_source` recorded; each a regular file, every range inside it, every length the one its dtype and
shape give and at most the memory available), one `WeightSourceError` line naming the weight and field;
and every read opens the file without blocking and only reads a regular file.
"""

from __future__ import annotations

import hashlib
import math
import os
import re
import stat
from pathlib import Path
from typing import Any, Iterator

from ..fileio import OutsideFolderError, confined

CHUNK = 16 << 20
ELEMENT_BYTES = {"FLOAT": 4, "FLOAT16": 2, "BFLOAT16": 2, "UINT8": 1, "INT8": 1, "INT32": 4, "INT64": 8, "BOOL": 1}
_SHA256 = re.compile(r"^[0-9a-f]{64}$")


class WeightSourceError(ValueError):
    """The ONNX cannot name a source for a weight: one line naming the file or initializer."""


def _external(init) -> dict[str, str]:
    return {e.key: e.value for e in init.external_data}


def _chunks(path: Path, offset: int, length: int) -> Iterator[bytes]:
    """The bytes [offset, offset + length) of `path` in CHUNK-sized `pread`s (never the whole range at once),
    opened without blocking: anything but a regular file is refused."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        raise WeightSourceError(f"{path}: cannot open it ({e.strerror})") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise WeightSourceError(f"{path}: not a regular file; refused")
        end = offset + length
        while offset < end:
            b = os.pread(fd, min(CHUNK, end - offset), offset)
            if not b:
                raise WeightSourceError(f"{path}: ends before byte {end}")
            offset += len(b)
            yield b
    finally:
        os.close(fd)


def range_sha256(path: Path, offset: int, length: int) -> str:
    h = hashlib.sha256()
    for b in _chunks(path, offset, length):
        h.update(b)
    return h.hexdigest()


def checkpoint_ranges(folder) -> tuple[Path, dict[str, list[dict]]] | None:
    """For an export folder (ExportFolder) that references its checkpoint (manifest `weight_source`; None for
    any other): (the checkpoint, read as the runners read it: its recorded files only, each checked,
    checkpoint/recorded.py; {program weight name: its ranges in the checkpoint's shards} for every weight
    stored there as the program holds it). WeightSourceError (one line naming the file) when the checkpoint
    is missing or changed."""
    from ..checkpoint.byte_ranges import StoredTensor, stream_weights
    from ..checkpoint.files import CheckpointError
    from ..checkpoint.recorded import recorded_checkpoint

    entry = folder.manifest.get("weight_source")
    if entry is None:
        return None
    try:
        prefix, out = str(entry.get("prefix", "")), {}
        build = folder.options().build
        with recorded_checkpoint(entry, dtype=folder.dtype(), expert_format=build.expert_format) as opened:
            ckpt = Path(str(entry["resolved"]))  # the recorded files only: ranges in no other file
            for name, t in stream_weights(ckpt, opened=opened):
                if isinstance(t, StoredTensor):
                    out[prefix + name] = [{"file": r.file.name, "offset": r.offset, "length": r.nbytes}
                                          for r in t.ranges]
    except (CheckpointError, OSError) as e:
        raise WeightSourceError(f"{folder.path}: weights referenced in the checkpoint: {e}") from None
    return ckpt, out


def _ranges_sha256(folder: Path, ranges: list[dict]) -> str:
    h = hashlib.sha256()
    for r in ranges:
        for b in _chunks(folder / r["file"], r["offset"], r["length"]):
            h.update(b)
    return h.hexdigest()


def weight_sources(onnx_path: Path, checkpoint: tuple[Path, dict[str, list[dict]]] | None = None) -> dict[str, dict]:
    """{initializer name: source} for every initializer of `onnx_path` (module docstring). The graph is read
    without its external data; each external range is hashed in chunks. `checkpoint`: `checkpoint_ranges` of
    the export's referenced checkpoint (the sources of the initializers at `REFERENCE_LOCATION`)."""
    import onnx

    from .onnx_weights import REFERENCE_LOCATION

    model = onnx.load(str(onnx_path), load_external_data=False)
    folder = Path(onnx_path).parent
    out: dict[str, dict] = {}
    for init in model.graph.initializer:
        entry = {"dtype": onnx.TensorProto.DataType.Name(init.data_type), "shape": list(init.dims)}
        if init.data_location == onnx.TensorProto.EXTERNAL and _external(init).get("location") == REFERENCE_LOCATION:
            ckpt, ranges = checkpoint or (None, {})
            if init.name not in ranges:
                raise WeightSourceError(f"{onnx_path}: initializer {init.name!r} is not stored in the referenced "
                                        "checkpoint as the program holds it (converted: another dtype or expert "
                                        "format); export with the checkpoint's --dtype to strip the engine")
            r = ranges[init.name]
            entry.update(checkpoint=True, ranges=r, length=sum(x["length"] for x in r), sha256=_ranges_sha256(ckpt, r))
        elif init.data_location == onnx.TensorProto.EXTERNAL:
            ext = _external(init)
            data = folder / ext["location"]
            if Path(ext["location"]).name != ext["location"] or not data.is_file():
                raise WeightSourceError(f"{onnx_path}: initializer {init.name!r} points at {ext['location']!r}, "
                                        "not a file of the export folder")
            offset, length = int(ext.get("offset", 0)), int(ext.get("length", data.stat().st_size))
            if offset + length > data.stat().st_size:
                raise WeightSourceError(f"{data}: initializer {init.name!r} range {offset}+{length} passes its end")
            entry.update(file=data.name, offset=offset, length=length, sha256=range_sha256(data, offset, length))
        else:
            raw = inline_bytes(init)
            entry.update(file=Path(onnx_path).name, inline=True, length=len(raw),
                         sha256=hashlib.sha256(raw).hexdigest())
        out[init.name] = entry
    if out and all(e.get("inline") for e in out.values()):
        raise WeightSourceError(f"{onnx_path}: every weight is inside the graph (no external data file); "
                                "a stripped engine refits from the export's data file: export with external data")
    return out


def strip_plan(trt, config, onnx_path: Path, checkpoint: tuple[Path, dict[str, list[dict]]] | None = None
               ) -> dict[str, dict]:
    """Set the weight-stripping flags on a builder config; the source of every weight the plan leaves out."""
    sources = weight_sources(onnx_path, checkpoint)
    config.set_flag(trt.BuilderFlag.STRIP_PLAN)
    config.set_flag(trt.BuilderFlag.REFIT_IDENTICAL)
    return sources


def inline_bytes(init) -> bytes:
    """The little-endian bytes of an inline initializer (raw_data, or its typed field)."""
    from onnx import numpy_helper

    if init.HasField("raw_data"):
        return init.raw_data
    return numpy_helper.to_array(init).tobytes()


def read_weight(folder: Path, name: str, src: dict, inline: dict[str, bytes] | None = None,
                checkpoint: Path | None = None) -> bytes:
    """One weight's bytes from its recorded source (in the export `folder`, or for a `"checkpoint"` source in
    the `checkpoint` folder), checked against its recorded length and sha256; a mismatch is one line naming
    the weight and the file (the data changed after the build)."""
    try:
        if src.get("checkpoint"):
            ranges = src["ranges"]
            files = [confined(Path(str(checkpoint)), r["file"], what="checkpoint folder") for r in ranges]
            where = files[0]
            raw = b"".join(b for f, r in zip(files, ranges) for b in _chunks(f, r["offset"], r["length"]))
        elif src.get("inline"):
            where, raw = Path(folder) / src["file"], (inline or {}).get(name)
            if raw is None:
                raise WeightSourceError(f"{where}: initializer {name!r} is not in the graph")
        else:
            where = confined(folder, src["file"], what="export folder")
            raw = b"".join(_chunks(where, src["offset"], src["length"]))
    except OutsideFolderError as e:
        raise WeightSourceError(f"weight {name!r}: {e}") from None
    if len(raw) != src["length"] or hashlib.sha256(raw).hexdigest() != src["sha256"]:
        raise WeightSourceError(f"{where}: weight {name!r} no longer matches the engine's recorded sha256; "
                                "rebuild the engine")
    return raw


def inline_weights(onnx_path: Path) -> dict[str, bytes]:
    """{name: bytes} of the graph's inline initializers (small tensors only; the external data is not read)."""
    import onnx

    model = onnx.load(str(onnx_path), load_external_data=False)
    return {i.name: inline_bytes(i) for i in model.graph.initializer if i.data_location != onnx.TensorProto.EXTERNAL}


def parse_onnx(parser, onnx_path: Path, folder, checkpoint: tuple[Path, dict] | None) -> tuple[bool, list]:
    """(parsed, the tensors handed to the parser, which must outlive it and the build). An export that
    references its checkpoint (`checkpoint`: its `checkpoint_ranges`; `folder`: its ExportFolder): the graph
    without its data, every initializer at `REFERENCE_LOCATION` handed over from the checkpoint's tensors
    (`IParser.load_model_proto` + `load_initializer`); any other: parsed from the file."""
    if checkpoint is None:
        return bool(parser.parse_from_file(str(onnx_path))), []
    import onnx

    from ..checkpoint.reference import referenced_tensors
    from .onnx_weights import REFERENCE_LOCATION

    model = onnx.load(str(onnx_path), load_external_data=False)
    names = {i.name for i in model.graph.initializer if _external(i).get("location") == REFERENCE_LOCATION}
    keep = [(n, t.contiguous()) for n, t in referenced_tensors(folder.manifest["weight_source"], dtype=folder.dtype(),
                                                               expert_format=folder.options().build.expert_format)
            if n in names]
    parsed = parser.load_model_proto(onnx_path.read_bytes(), str(onnx_path)) and \
        all(parser.load_initializer(n, t.data_ptr(), t.nbytes) for n, t in keep) and parser.parse_model_proto()
    return bool(parsed), keep


def _int(src: dict, key: str, where: str, low: int = 0) -> int:
    v = src.get(key)
    if not isinstance(v, int) or isinstance(v, bool) or v < low:
        raise WeightSourceError(f"{where}.{key} = {str(v)[:40]}: must be an integer >= {low}")
    return v


def _range(path: Path, offset: int, length: int, where: str) -> None:
    """`path` a regular file holding [offset, offset + length) (stat only: nothing is opened)."""
    try:
        st = os.stat(path)
    except OSError as e:
        raise WeightSourceError(f"{where}: {path}: {e.strerror}") from None
    if not stat.S_ISREG(st.st_mode):
        raise WeightSourceError(f"{where}: {path} is not a regular file; refused")
    if offset + length > st.st_size:
        raise WeightSourceError(f"{where}: bytes {offset}+{length} pass the end of {path} ({st.st_size} bytes)")


def _source(folder: Path, src: Any, checkpoint: dict[str, Path], where: str, memory: int) -> None:
    if not isinstance(src, dict):
        raise WeightSourceError(f"{where}: must be an object {{dtype, shape, length, sha256, ...}}")
    if src.get("dtype") not in ELEMENT_BYTES:
        raise WeightSourceError(f"{where}.dtype = {str(src.get('dtype'))[:40]!r}: must be one of "
                                f"{sorted(ELEMENT_BYTES)}")
    shape = src.get("shape")
    if not isinstance(shape, list) or len(shape) > 8 or not all(isinstance(d, int) and d >= 0 for d in shape):
        raise WeightSourceError(f"{where}.shape = {str(shape)[:60]}: must be a list of sizes")
    if not isinstance(src.get("sha256"), str) or not _SHA256.match(src["sha256"]):
        raise WeightSourceError(f"{where}.sha256 = {str(src.get('sha256'))[:70]!r}: must be 64 lowercase hex digits")
    length, want = _int(src, "length", where), math.prod(shape) * ELEMENT_BYTES[src["dtype"]]
    if length != want:
        raise WeightSourceError(f"{where}.length = {length}: its dtype and shape make {want} bytes")
    if length > memory:
        raise WeightSourceError(f"{where}.length = {length}: more than the memory available ({memory} bytes)")
    if src.get("checkpoint"):
        ranges = src.get("ranges")
        if not isinstance(ranges, list) or not ranges or not all(isinstance(r, dict) for r in ranges):
            raise WeightSourceError(f"{where}.ranges: must be a non-empty list of {{file, offset, length}}")
        for i, r in enumerate(ranges):
            at = f"{where}.ranges[{i}]"
            if not isinstance(r.get("file"), str) or r["file"] not in checkpoint:
                raise WeightSourceError(f"{at}.file = {str(r.get('file'))[:80]!r}: not one of the files the export's "
                                        "referenced checkpoint recorded; refused")
            _range(checkpoint[r["file"]], _int(r, "offset", at), _int(r, "length", at), at)
        if sum(r["length"] for r in ranges) != length:
            raise WeightSourceError(f"{where}.ranges: {sum(r['length'] for r in ranges)} bytes in all, length {length}")
    elif not src.get("inline"):  # an inline weight is read from the export's graph, by name
        try:
            path = confined(folder, src.get("file"), what="export folder")
        except OutsideFolderError as e:
            raise WeightSourceError(f"{where}.file: {e}") from None
        _range(path, _int(src, "offset", where), length, where)


def check_sources(table: Any, folder: Path, checkpoint: dict[str, Path] | None = None) -> dict[str, dict]:
    """The `weights` table of a stripped engine's `model.engine.json` (module docstring), checked before any
    source is read: its schema, every file source inside the export `folder`, every checkpoint range in one
    of `checkpoint`'s files ({recorded name: path}: the export's referenced checkpoint; None: there is
    none), each a regular file holding the range. WeightSourceError naming the weight and field."""
    import psutil

    where = Path(folder) / "model.engine.json"
    if not isinstance(table, dict) or not all(isinstance(k, str) for k in table):
        raise WeightSourceError(f"{where}: weights must be an object {{weight name: source}}")
    memory = psutil.virtual_memory().available
    for name, src in table.items():
        _source(Path(folder), src, checkpoint or {}, f"{where}: weights[{name[:80]!r}]", memory)
    return table
