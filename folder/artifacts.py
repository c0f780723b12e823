"""The export folder: artifacts renamed into place, and one `manifest.json` every stage adds to.

Layout of an export folder `OUT/`:

    OUT/manifest.json     what was exported from what (schema below)
    OUT/<files>           one or more files per artifact (`model.pt2`, `model.aoti.pt2`, `model.onnx`, ...)

Nothing is ever half-written: a stage writes into a staging folder `OUT/.tmp-<name>-XXXX/` and the files
are `os.replace`d into `OUT/` only when the stage succeeded; the manifest gains the artifact's entry after
its files are in place, and is itself replaced atomically. On failure the staging folder is removed and
the manifest is untouched. (One writer per folder at a time; stages run sequentially.)

Adding an artifact from a later stage (ONNX, TensorRT) is one call:

    with write_artifact(out_dir, "onnx", extra={"flavor": "ort"}) as tmp:
        export_onnx(ep, cfg, tmp)                      # write any files into `tmp`
    # -> OUT/model.onnx (+ external data) in place, manifest["artifacts"]["onnx"] listed with sha256

or, for files already written in place by other means: `update_manifest(out_dir, "trt", [path], extra)`.
`ExportFolder.open(out_dir)` reads a folder back (config, dtype, checkpoint, artifact paths).

manifest.json (schema 1):
    schema, k3x            format version; the k3x version that wrote it
    config, config_hash    `K3Config.to_dict()` and `K3Config.hash()`: the architecture only
    options                {"kernels", "expert_format", "activations", "trunk", "max_context"}: the build and cache
                           options (model/options.ModelOptions; older manifests kept them inside `config`)
    dtype, weights         "fp32" | "bf16"; false when traced on the meta device (no weight values)
    checkpoint             {"path", "hash"} or null (preset with random init / meta)
    versions               torch, triton, onnx, onnxruntime, k3x (null when not installed)
    dynamic_dims           {"batch": {"min", "opt", "max"}, "seq": ..., "past_seq": ...}
    op_counts              {"k3::kda": 69, ...} in the traced graph
    trace                  {"mode": "stamped" | "per-layer", "fallback": why stamping fell back, or null}
    io                     {"inputs": [...], "outputs": [...]} flat I/O names, and
    state                  the state contract (model/state_contract.py): every state tensor's layer, kind,
                           shape per sequence, axes, dtype, update and snapshot granularity, and the latent
                           pool's block size; a folder whose contract disagrees with its config is refused
    artifacts              {name: {"files": [{"path", "bytes", "sha256"}], **extra}}
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any, Iterator

import torch

from ..fileio import confined, normal_permissions, sha256
from ..model.config import K3Config
from ..model.options import ModelOptions
from ..model.state import state_specs
from ..model.state_contract import contract_mismatch, state_contract
from ..plan.dtypes import dtype_name
from . import trust
from .dims import DYNAMIC_DIMS
from .schema import DTYPES, MANIFEST, SCHEMA, ManifestError
from .trust import validate_manifest

# distribution names per package (onnxruntime may be installed as its GPU build)
_DISTRIBUTIONS = {"torch": ("torch",), "triton": ("triton",), "onnx": ("onnx",),
                  "onnxruntime": ("onnxruntime", "onnxruntime-gpu"), "k3x": ("k3x",)}


# the command that writes each artifact into a folder (named in "no such artifact" errors)
MAKES = {"pt2": "k3x export --target pt2", "onnx": "k3x export --target onnx", "aoti": "k3x export --target aoti",
         "trt": "k3x build-engine DIR (after k3x export --target onnx)"}


def package_versions() -> dict[str, str | None]:
    """Installed versions by distribution metadata (nothing is imported)."""
    out: dict[str, str | None] = {}
    for pkg, dists in _DISTRIBUTIONS.items():
        out[pkg] = None
        for d in dists:
            try:
                out[pkg] = metadata.version(d)
                break
            except metadata.PackageNotFoundError:
                continue
    return out


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write `path` under a temporary name beside it and rename it into place (nothing half-written)."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".tmp-{path.name}-", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        normal_permissions(tmp)  # mkstemp creates 0600; artifacts are for everyone to read
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _write_json_atomic(path: Path, data: dict) -> None:
    atomic_write_bytes(path, (json.dumps(data, indent=2, sort_keys=False) + "\n").encode())


def read_manifest(out_dir: str | Path) -> dict[str, Any]:
    """The manifest of `out_dir`, its schema checked (folder/trust.py); errors name the field."""
    path = Path(out_dir) / MANIFEST
    try:
        data = json.loads(path.read_bytes().decode("utf-8"), parse_constant=_no_constant)
    except FileNotFoundError:
        raise ManifestError(f"{path}: no manifest (run `k3x export` into this folder first)") from None
    except (ValueError, RecursionError) as e:  # JSONDecodeError, UnicodeDecodeError, NaN/Infinity, deep nesting
        raise ManifestError(f"{path}: not valid JSON ({str(e)[:200]})") from None
    except OSError as e:
        raise ManifestError(f"{path}: cannot read ({e})") from None
    return validate_manifest(data, str(path))


def _no_constant(name: str) -> None:
    raise ValueError(f"{name} is not a JSON number")


def init_manifest(out_dir: str | Path, cfg: K3Config, *, dtype: torch.dtype, weights: bool,
                  op_counts: dict[str, int], checkpoint: str | Path | None = None,
                  checkpoint_hash: str | None = None, options: ModelOptions | None = None,
                  serving: dict[str, Any] | None = None, trace: dict[str, Any] | None = None,
                  weight_source: dict[str, Any] | None = None) -> dict[str, Any]:
    """Start a fresh manifest (no artifacts) in `out_dir`, created if needed; replaces an older one.
    `options`: what the program was built with (default: reference kernels, dense experts, growing cache).
    `serving`: the serving-step interface (exporter/serving.py `serving_manifest`); `io` then names its I/O.
    `trace`: how the program was traced (exporter/trace.trace_recorded; default per-layer).
    `weight_source`: the checkpoint the artifacts reference instead of holding weights (checkpoint/reference.py)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    options = options or ModelOptions()
    specs, capacity = state_specs(cfg, options.cache), options.cache.max_context
    data = {
        "schema": SCHEMA,
        "k3x": package_versions()["k3x"],
        "config": cfg.to_dict(),
        "config_hash": cfg.hash(),
        "options": options.to_dict(),
        "dtype": dtype_name(dtype),
        "weights": weights,
        "checkpoint": None if checkpoint is None else {"path": str(Path(checkpoint).resolve()),
                                                      "hash": checkpoint_hash},
        "versions": package_versions(),
        "dynamic_dims": {n: {"min": r.min, "opt": r.opt, "max": r.max} for n, r in DYNAMIC_DIMS.items()},
        "op_counts": dict(op_counts),
        "trace": dict(trace or {"mode": "per-layer", "fallback": None}),
        "io": {"inputs": ["input_ids"] + [s.input_name for s in specs],
               "outputs": ["logits"] + [s.output_name for s in specs]},
        "state": state_contract(cfg, dtype, cache=options.cache,
                                block_size=None if serving is None else serving["block_size"]),
        "static_cache": None if capacity is None else {"max_context": capacity, "length_input": "past_length"},
        "artifacts": {},
    }
    if weight_source is not None:
        data["weight_source"] = weight_source
    if serving is not None:
        data["serving"] = serving
        data["io"] = {"inputs": serving["inputs"], "outputs": serving["outputs"]}
    _write_json_atomic(out / MANIFEST, data)
    return data


def update_manifest(out_dir: str | Path, artifact_name: str, files: list[str | Path],
                    extra: dict[str, Any] | None = None, digests: dict[str, str] | None = None) -> dict[str, Any]:
    """Record (or replace) artifact `artifact_name`: its files (inside `out_dir`) with size and sha256,
    plus JSON-serialisable `extra` fields. `digests`: file name -> sha256 its writer took of the bytes as
    it wrote them (streamed weights: saves reading tens of GB back); other files are hashed here.
    Returns the updated manifest."""
    out = Path(out_dir)
    data = read_manifest(out)
    entries = []
    for f in files:
        f = Path(f)
        p = confined(out, f.name if f.is_absolute() and f.parent.resolve() == out.resolve() else str(f),
                     error=ManifestError, what="export folder")
        if not p.is_file():
            raise ManifestError(f"{p}: artifact {artifact_name!r} lists a file that does not exist")
        digest = (digests or {}).get(p.name) or sha256(p)
        entries.append({"path": p.name, "bytes": p.stat().st_size, "sha256": digest})
    data["artifacts"][artifact_name] = {"files": entries, **(extra or {})}
    _write_json_atomic(out / MANIFEST, data)
    return data


def listed_files(manifest: dict[str, Any]) -> tuple[set[str], set[str]]:
    """(files, folders) a manifest lists, as paths relative to its folder: manifest.json, every artifact's
    files and, for a sharded export, each rank folder with its manifest.json and the files the top manifest
    records for it. Anything else in the folder is not k3x's (folder/staging.py refuses to replace it)."""
    files = {MANIFEST} | {f["path"] for a in manifest["artifacts"].values() for f in a["files"]}
    folders: set[str] = set()
    try:
        for r in (manifest.get("parallel") or {}).get("ranks") or []:
            rank_files = {f["path"] for f in r["files"]}
            if not (isinstance(r["dir"], str) and all(isinstance(f, str) for f in rank_files)):
                raise TypeError("not names")
            folders.add(r["dir"])
            files |= {f"{r['dir']}/{MANIFEST}"} | rank_files
    except (AttributeError, KeyError, TypeError):  # a malformed parallel entry lists no rank folder
        pass
    return files, folders


def refuse_unlisted(out_dir: str | Path, names: list[str]) -> None:
    """A ManifestError naming the first of `names` that is already in `out_dir` but not listed in its
    manifest (a user's file): writing an artifact never overwrites one."""
    out = Path(out_dir)
    listed = listed_files(read_manifest(out))[0]
    for n in names:
        if os.path.lexists(out / n) and n not in listed:
            raise ManifestError(f"{out / n}: exists and is not a file the manifest lists; refusing to overwrite it "
                                "(move it out of the folder first)")


@contextlib.contextmanager
def write_artifact(out_dir: str | Path, artifact_name: str, extra: dict[str, Any] | None = None, *,
                   primary: str | None = None, digests: dict[str, str] | None = None) -> Iterator[Path]:
    """Yield an empty staging folder inside `out_dir`; on success move every file written there into
    `out_dir` (same file names) and record them in the manifest, `primary` first (else by name; see
    `ExportFolder.artifact`); a file of that name the manifest does not list is refused, never overwritten
    (`refuse_unlisted`). On any exception nothing moves and the staging folder is deleted.
    `extra` and `digests` (file name -> sha256 taken while writing) may be filled in inside the block."""
    out = Path(out_dir)
    if not (out / MANIFEST).is_file():
        raise ManifestError(f"{out / MANIFEST}: no manifest; call init_manifest first")
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{artifact_name}-", dir=out))
    try:
        yield tmp
        names = sorted((p.name for p in tmp.iterdir()), key=lambda n: (n != primary, n))
        if not names:
            raise ManifestError(f"artifact {artifact_name!r}: the stage wrote no files")
        bad = [n for n in names if not (tmp / n).is_file()]
        if bad:
            raise ManifestError(f"artifact {artifact_name!r}: {bad} are not plain files")
        refuse_unlisted(out, names)
        for n in names:
            os.replace(tmp / n, out / n)
        update_manifest(out, artifact_name, names, extra, digests)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@dataclass(frozen=True)
class ExportFolder:
    """Read access to an export folder for later stages and runners."""

    path: Path
    manifest: dict[str, Any]

    @classmethod
    def open(cls, path: str | Path) -> ExportFolder:
        """The folder, its manifest's schema checked and its state contract checked against its config."""
        folder = cls(Path(path), read_manifest(path))
        if folder.records_contract:
            folder.state_contract()
        return folder

    @property
    def records_contract(self) -> bool:
        """Whether the manifest records a state contract (manifests before it listed the state tensors)."""
        return not isinstance(self.manifest.get("state", []), list)

    def state_contract(self) -> dict[str, Any]:
        """The state contract of the folder's config, options and dtype (model/state_contract.py); a
        ManifestError in one line when the manifest records a different one."""
        serving = self.manifest.get("serving")
        block = serving.get("block_size") if isinstance(serving, dict) else None
        expected = state_contract(self.config(), self.dtype(), cache=self.options().cache, block_size=block)
        if self.records_contract:
            problem = contract_mismatch(self.manifest["state"], expected)
            if problem:
                raise ManifestError(f"{self.path / MANIFEST}: {problem}; the state contract must match the "
                                    "config (re-export)")
        return expected

    def config(self) -> K3Config:
        try:
            return K3Config.from_dict(self.manifest["config"])
        except (TypeError, KeyError, ValueError) as e:  # ConfigError names the field
            raise ManifestError(f"{self.path / MANIFEST}: config: {str(e)[:300]}") from None

    def options(self) -> ModelOptions:
        """The build and cache options the folder was exported with."""
        try:
            return ModelOptions.from_manifest(self.manifest)
        except (TypeError, ValueError) as e:  # ConfigError names the field
            raise ManifestError(f"{self.path / MANIFEST}: options: {str(e)[:300]}") from None

    def dtype(self) -> torch.dtype:
        return DTYPES[self.manifest["dtype"]]

    def checkpoint(self) -> Path | None:
        c = self.manifest.get("checkpoint")
        return None if c is None else Path(c["path"])

    def files(self, name: str) -> list[Path]:
        try:
            entry = self.manifest["artifacts"][name]
        except KeyError:
            have = ", ".join(sorted(self.manifest["artifacts"])) or "none"
            raise ManifestError(f"{self.path}: no {name} artifact (it has: {have}); make it with "
                                f"`{MAKES.get(name, 'k3x export')}`") from None
        return [trust.confined(self.path, f["path"]) for f in entry["files"]]

    def checked_files(self, name: str, *, check_hash: bool = True) -> list[Path]:
        """The artifact's files, each confined to the folder, present, of the recorded size and (unless
        `check_hash` is False) sha256 — the only way runners get a path to load."""
        entry = self.manifest["artifacts"].get(name)
        paths = self.files(name)
        for p, f in zip(paths, entry["files"]):
            if not p.is_file():
                raise ManifestError(f"{p}: listed in the manifest but missing")
            if p.stat().st_size != f["bytes"]:
                raise ManifestError(f"{p}: {p.stat().st_size} bytes, the manifest records {f['bytes']}: changed "
                                    "since the export; refused")
            if check_hash and sha256(p) != f["sha256"]:
                raise ManifestError(f"{p}: sha256 differs from the manifest: changed since the export; refused")
        return paths

    def tokenizer_files(self) -> set[str]:
        """Names of the `tokenizer` artifact's files, each checked (confined, size, sha256) — the only
        tokenizer files a command may read from an export (text/tokenizer.py `listed`); empty when none."""
        if "tokenizer" not in self.manifest["artifacts"]:
            return set()
        return {p.name for p in self.checked_files("tokenizer")}

    def artifact(self, name: str) -> Path:
        """The artifact's primary (first listed) file."""
        return self.files(name)[0]

    def verify(self) -> list[str]:
        """Files whose bytes no longer match the recorded sha256 (or are missing)."""
        bad = []
        for entry in self.manifest["artifacts"].values():
            for f in entry["files"]:
                p = trust.confined(self.path, f["path"])
                if not p.is_file() or sha256(p) != f["sha256"]:
                    bad.append(str(p))
        return bad
