"""What an export folder is trusted with: a manifest of the right shape, files inside the folder whose
sha256 matches, and `.pt2` archives that cannot run code when loaded.

Export folders are shared between machines and people, so nothing read from one is taken on faith:
- `validate_manifest` checks the manifest's schema before any field is used; every problem is one
  `ManifestError` line naming the field (e.g. `artifacts.onnx.files[0].sha256`).
- `confined` resolves an artifact file name (symlinks too) and refuses anything outside the folder:
  manifest paths are bare file names (no `/`, `..`, absolute paths).
- `check_pt2_archive` reads a `.pt2` zip's own tables before `torch.export.load` sees it. torch unpickles
  (`weights_only=False`) every weight or constant whose payload config says `use_pickle`, every opaque /
  script-object constant, the legacy `weights/<model>.pt` files, and falls back to a full unpickle of
  `sample_inputs` when the safe load fails. k3x writes none of these (plain tensors are raw bytes), so an
  archive that has one is refused, and `sample_inputs` must load with `weights_only=True`.
- AOTInductor packages are native code by design (a shared library that is dlopen'ed): they are loaded
  only after their sha256 matches the manifest, which makes them exactly as trusted as the manifest.
"""

from __future__ import annotations

import io
import json
import math
import re
import zipfile
from pathlib import Path
from typing import Any

from ..fileio import confined as _confined, safe_file_name
from .artifacts import DTYPES, SCHEMA, ManifestError

_SHA256 = re.compile(r"^[0-9a-f]{64}$")
# entries a torch.export.save archive of one program may hold (after the archive's top folder)
_PT2_ENTRIES = re.compile(r"^(archive_format|archive_version|byteorder|version|\.data/version|\.data/serialization_id|"
                          r"models/[\w.-]+\.json|data/weights/(weight_\d+|[\w.-]+_weights_config\.json)|"
                          r"data/constants/(tensor_\d+|[\w.-]+_constants_config\.json)|"
                          r"data/sample_inputs/[\w.-]+\.pt)$")
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

def _payload_config(z: zipfile.ZipFile, name: str, path: Path) -> dict[str, Any]:
    try:
        data = json.loads(z.read(name), parse_constant=lambda c: math.nan)
        config = data["config"]
        if not isinstance(config, dict):
            raise TypeError("config is not an object")
        return config
    except (ValueError, KeyError, TypeError, RecursionError) as e:
        raise UnsafeArtifactError(f"{path}: {name} is not a payload config ({e}); refused") from None


def check_pt2_archive(path: str | Path) -> None:
    """Refuse a `.pt2` archive that `torch.export.load` would unpickle anything from (module docstring)."""
    import torch

    path = Path(path)
    try:
        z = zipfile.ZipFile(path)
    except (zipfile.BadZipFile, OSError) as e:
        raise UnsafeArtifactError(f"{path}: not a pt2 (zip) archive ({e})") from None
    with z:
        names = z.namelist()
        tops = {n.split("/", 1)[0] for n in names}
        if len(tops) != 1 or any("/" not in n for n in names):
            raise UnsafeArtifactError(f"{path}: not one torch.export archive (top folders {sorted(tops)[:4]})")
        top = tops.pop() + "/"
        for n in names:
            rel = n[len(top):]
            if rel and not rel.endswith("/") and not _PT2_ENTRIES.match(rel):
                raise UnsafeArtifactError(f"{path}: unexpected archive entry {_short(rel)} (k3x archives hold raw "
                                          "tensors and JSON only); refused")
        for n in names:
            rel = n[len(top):]
            if rel.endswith(("_weights_config.json", "_constants_config.json")):
                for fqn, meta in _payload_config(z, n, path).items():
                    if not isinstance(meta, dict) or meta.get("use_pickle") is not False:
                        raise UnsafeArtifactError(f"{path}: {rel} marks {_short(fqn)} as pickled; loading it would run "
                                                  "code, refused")
                    if not re.fullmatch(r"(weight|tensor)_\d+", str(meta.get("path_name"))):
                        raise UnsafeArtifactError(f"{path}: {rel}: {_short(fqn)} is not a raw tensor "
                                                  f"(path_name {_short(meta.get('path_name'))}); refused")
            elif rel.startswith("data/sample_inputs/"):
                try:
                    torch.load(io.BytesIO(z.read(n)), weights_only=True)
                except Exception as e:  # noqa: BLE001 - any failure would make torch retry with a full unpickle
                    raise UnsafeArtifactError(f"{path}: {rel} does not load as plain tensors "
                                              f"({type(e).__name__}); loading it would run code, refused") from None
