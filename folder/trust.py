"""What an export folder is trusted with: a manifest of the right shape, files inside the folder whose
sha256 matches, and `.pt2` archives that cannot run code when loaded.

Export folders are shared between machines and people, so nothing read from one is taken on faith:
- `validate_manifest` checks the manifest's schema before any field is used; every problem is one
  `ManifestError` line naming the field (e.g. `artifacts.onnx.files[0].sha256`).
- `confined` resolves an artifact file name (symlinks too) and refuses anything outside the folder:
  manifest paths are bare file names (no `/`, `..`, absolute paths).
- `checked_pt2` opens a `.pt2` once and hands `torch.export.load` the very bytes it checked. torch unpickles
  (`weights_only=False`) every weight or constant whose payload config says `use_pickle`, every opaque /
  script-object constant, the legacy `weights/<model>.pt` files, and falls back to a full unpickle of
  `sample_inputs` when the safe load fails. k3x writes none of these (plain tensors are raw bytes), so an
  archive that has one is refused, and `sample_inputs` must load with `weights_only=True`. Python's `zipfile`
  and torch's reader can resolve one archive to different records (a duplicate name, a name cut at NUL, a
  case-insensitive lookup): the zip structure is read strictly first (folder/zip_check.py: anything two
  readers could read differently is refused), torch's reader must then list the same entries and find each
  at the same record, and the payloads are checked with the bytes that reader returns. The check and the load
  share one open file; what is parsed is served from the copy that was checked (`zip_check.FrozenArchive`).
- AOTInductor packages are native code by design (a shared library that is dlopen'ed): they are loaded
  only after their sha256 matches the manifest, which makes them exactly as trusted as the manifest.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import math
import os
import re
from pathlib import Path
from typing import Any, Iterator

from ..fileio import confined as _confined, safe_file_name
from .schema import DTYPES, SCHEMA, ManifestError
from .zip_check import FrozenArchive, Record, ZipLayoutError, freeze

_SHA256 = re.compile(r"^[0-9a-f]{64}$")
# entries a torch.export.save archive of one program may hold (after the archive's top folder)
_PT2_ENTRIES = re.compile(r"^(archive_format|archive_version|byteorder|version|\.data/version|\.data/serialization_id|"
                          r"models/[\w.-]+\.json|data/weights/(weight_\d+|[\w.-]+_weights_config\.json)|"
                          r"data/constants/(tensor_\d+|[\w.-]+_constants_config\.json)|"
                          r"data/sample_inputs/[\w.-]+\.pt)$")
_RAW = re.compile(r"data/(weights/weight|constants/tensor)_\d+$")  # raw tensor bytes, never unpickled
_MAX_FIELD = 80  # longest value echoed in an error


class UnsafeArtifactError(ManifestError):
    """An artifact would run code, or be read from outside its folder, if it were loaded."""


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= _MAX_FIELD else text[:_MAX_FIELD] + "...'"


# --- manifest schema -----------------------------------------------------------------------------

def _err(where: str, field: str, value: Any, want: str) -> Exception:
    return ManifestError(f"{where}: {field}={_short(value)}: {want}")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _need(d: dict, key: str, where: str, field: str, kind: type | tuple, want: str) -> Any:
    if key not in d:
        raise ManifestError(f"{where}: {field} is missing")
    v = d[key]
    if not isinstance(v, kind) or (kind is int and isinstance(v, bool)):
        raise _err(where, field, v, want)
    return v


def validate_manifest(data: Any, where: str) -> dict[str, Any]:
    """`data` (parsed manifest.json) if it has the schema artifacts.py documents, else a ManifestError."""
    if not isinstance(data, dict):
        raise _err(where, "manifest", type(data).__name__, "must be a JSON object")
    schema = _need(data, "schema", where, "schema", int, "must be an integer")
    if schema != SCHEMA:
        raise _err(where, "schema", schema, f"this k3x reads schema {SCHEMA}")
    _need(data, "config", where, "config", dict, "must be an object")
    dtype = _need(data, "dtype", where, "dtype", str, f"must be one of {sorted(DTYPES)}")
    if dtype not in DTYPES:
        raise _err(where, "dtype", dtype, f"must be one of {sorted(DTYPES)}")
    _need(data, "weights", where, "weights", bool, "must be true or false")
    ckpt = data.get("checkpoint")
    if ckpt is not None:
        if not isinstance(ckpt, dict):
            raise _err(where, "checkpoint", ckpt, "must be null or {path, hash}")
        _need(ckpt, "path", where, "checkpoint.path", str, "must be a string")
        if ckpt.get("hash") is not None and not isinstance(ckpt["hash"], str):
            raise _err(where, "checkpoint.hash", ckpt["hash"], "must be a string or null")
    dims = _need(data, "dynamic_dims", where, "dynamic_dims", dict, "must be an object")
    for name, r in dims.items():
        if not isinstance(r, dict) or not all(_is_int(r.get(k)) and r[k] >= 0 for k in ("min", "opt", "max")) \
                or not r["min"] <= r["opt"] <= r["max"]:
            raise _err(where, f"dynamic_dims.{name}", r, "must be {min, opt, max} integers, min <= opt <= max")
    arts = _need(data, "artifacts", where, "artifacts", dict, "must be an object {name: {files: [...]}}")
    for name, entry in arts.items():
        field = f"artifacts.{name}"
        if not isinstance(entry, dict):
            raise _err(where, field, entry, "must be an object with 'files'")
        files = _need(entry, "files", where, f"{field}.files", list, "must be a list")
        if not files:
            raise _err(where, f"{field}.files", files, "must list at least one file")
        for i, f in enumerate(files):
            fw = f"{field}.files[{i}]"
            if not isinstance(f, dict):
                raise _err(where, fw, f, "must be {path, bytes, sha256}")
            path = _need(f, "path", where, f"{fw}.path", str, "must be a file name")
            if not safe_file_name(path):
                raise _err(where, f"{fw}.path", path, "must be a bare file name inside the export folder")
            size = _need(f, "bytes", where, f"{fw}.bytes", int, "must be an integer")
            if size < 0:
                raise _err(where, f"{fw}.bytes", size, "must be >= 0")
            digest = _need(f, "sha256", where, f"{fw}.sha256", str, "must be 64 hex digits")
            if not _SHA256.match(digest):
                raise _err(where, f"{fw}.sha256", digest, "must be 64 lowercase hex digits")
    return data


# --- files inside the folder ---------------------------------------------------------------------

def confined(folder: Path, name: str) -> Path:
    """`folder / name` under fileio's one confinement rule, refused as an `UnsafeArtifactError`."""
    return _confined(folder, name, error=UnsafeArtifactError, what="export folder")


# --- pt2 archives --------------------------------------------------------------------------------

def _payload_config(data: bytes, rel: str, path: Path) -> dict[str, Any]:
    try:
        config = json.loads(data, parse_constant=lambda c: math.nan)["config"]
        if not isinstance(config, dict):
            raise TypeError("config is not an object")
        return config
    except (ValueError, KeyError, TypeError, RecursionError) as e:
        raise UnsafeArtifactError(f"{path}: {rel} is not a payload config ({e}); refused") from None


def _entry_names(records: list[Record], path: Path) -> list[str]:
    """The entries' names below the archive's one top folder, each one a torch.export archive may hold."""
    tops = {r.name.split("/", 1)[0] for r in records}
    if len(tops) != 1 or any("/" not in r.name for r in records):
        raise UnsafeArtifactError(f"{path}: not one torch.export archive (top folders {sorted(tops)[:4]})")
    top = tops.pop() + "/"
    rels = [r.name[len(top):] for r in records]
    for rel in rels:
        if not _PT2_ENTRIES.match(rel):
            raise UnsafeArtifactError(f"{path}: unexpected archive entry {_short(rel)} (k3x archives hold raw "
                                      "tensors and JSON only); refused")
    return rels


def _torch_reader(view: FrozenArchive, records: list[Record], rels: list[str], path: Path):
    """torch's own reader of `view`, shown to list the same entries and find each at the same record."""
    import torch

    view.seek(0)
    try:
        reader = torch._C.PyTorchFileReader(view)
        if reader.get_all_records() != rels:
            raise RuntimeError("it lists other entries than the central directory")
        for record, rel in zip(records, rels):
            if reader.get_record_header_offset(rel) != record.header:
                raise RuntimeError(f"it finds {rel} at another record")
    except (RuntimeError, ValueError, OSError) as e:
        reason = (str(e).strip().splitlines() or ["?"])[-1][:200]
        raise UnsafeArtifactError(f"{path}: torch's archive reader disagrees ({reason}); refused") from None
    return reader


def _check_payloads(reader, rels: list[str], path: Path) -> None:
    """The records torch would unpickle, read with torch's reader: none may be marked pickled."""
    import torch

    for rel in rels:
        if rel.endswith(("_weights_config.json", "_constants_config.json")):
            for fqn, meta in _payload_config(reader.get_record(rel), rel, path).items():
                if not isinstance(meta, dict) or meta.get("use_pickle") is not False:
                    raise UnsafeArtifactError(f"{path}: {rel} marks {_short(fqn)} as pickled; loading it would run "
                                              "code, refused")
                if not _RAW.fullmatch(f"data/{rel.split('/')[1]}/{meta.get('path_name')}"):
                    raise UnsafeArtifactError(f"{path}: {rel}: {_short(fqn)} is not a raw tensor "
                                              f"(path_name {_short(meta.get('path_name'))}); refused")
        elif rel.startswith("data/sample_inputs/"):
            try:
                torch.load(io.BytesIO(reader.get_record(rel)), weights_only=True)
            except Exception as e:  # noqa: BLE001 - any failure would make torch retry with a full unpickle
                raise UnsafeArtifactError(f"{path}: {rel} does not load as plain tensors "
                                          f"({type(e).__name__}); loading it would run code, refused") from None


def _stamp(fd: int) -> tuple[int, int, int]:
    """What a write to the file changes (not ctime: renaming another file over the path changes that too)."""
    st = os.fstat(fd)
    return st.st_ino, st.st_size, st.st_mtime_ns


@contextlib.contextmanager
def checked_pt2(path: str | Path, *, sha256: str | None = None) -> Iterator[FrozenArchive]:
    """The `.pt2` at `path`, opened once, as a file object to give `torch.export.load` (module docstring):
    its bytes hashed (when `sha256` is given), its zip structure read strictly (folder/zip_check.py), its
    entries listed and found by torch's own reader exactly as the central directory says, and every record
    torch could unpickle checked with the bytes that reader returns. The view serves all but the raw tensor
    bytes from the copy that was checked; a file written to (size, mtime) before the `with` block ends is
    refused: the raw tensor bytes torch read may then differ from the hashed ones (never from the checked)."""
    path = Path(path)
    with open(path, "rb") as f:
        stamp = _stamp(f.fileno())
        if sha256 is not None and hashlib.file_digest(f, "sha256").hexdigest() != sha256:
            raise UnsafeArtifactError(f"{path}: sha256 differs from the manifest (hashed from the file that is "
                                      "then checked and loaded): changed since the export; refused")
        try:
            view, records = freeze(f.fileno(), stamp[1], lambda r: bool(_RAW.fullmatch(r.name.partition("/")[2])))
        except ZipLayoutError as e:
            raise UnsafeArtifactError(f"{path}: not a pt2 archive torch and k3x read alike: {e}; refused") from None
        rels = _entry_names(records, path)
        _check_payloads(_torch_reader(view, records, rels, path), rels, path)
        view.seek(0)
        yield view
        if _stamp(f.fileno()) != stamp:
            raise UnsafeArtifactError(f"{path}: changed while it was being loaded; refused")


def check_pt2_archive(path: str | Path) -> None:
    """Refuse a `.pt2` archive that `torch.export.load` would unpickle anything from (`checked_pt2`)."""
    with checked_pt2(path):
        pass
