"""A stripped engine's weight sources (`model.engine.json`'s `weights`, read at load by runtime/engine_refit.py)
are trusted like artifacts: every source inside the export folder or among the referenced checkpoint's
recorded files, a regular file holding its range, the table schema-checked, before a byte is read
(`resolve_sources`, the refit's first step; no TensorRT here, so the checks are called directly). Crafted
tables opened files outside the folder, read /dev/zero into a MemoryError, hung on a FIFO and gave tracebacks."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest
from hostile_util import edit_manifest, released_fifo

from k3x.exporter.engine_weights import WeightSourceError, checkpoint_ranges, read_weight
from k3x.fileio import sha256
from k3x.runtime.base import RunnerError
from k3x.runtime.engine_refit import resolve_sources
from k3x.runtime.runners import open_folder

DATA = bytes(range(16))  # four fp32 values
SHARD = "model-00001-of-00001.safetensors"


def _entry(file: str, data: bytes = DATA, **over) -> dict:
    return {"file": file, "offset": 0, "length": len(data), "dtype": "FLOAT", "shape": [len(data) // 4],
            "sha256": hashlib.sha256(data).hexdigest(), **over}


@pytest.fixture()
def folder(tmp_path) -> Path:
    """An export folder holding `model.onnx.data`, and a file beside it (outside the folder)."""
    (tmp_path / "export").mkdir()
    (tmp_path / "export" / "model.onnx.data").write_bytes(DATA)
    (tmp_path / "outside.bin").write_bytes(DATA)
    return tmp_path / "export"


def _refused(folder: Path, table: object, *says: str) -> str:
    with pytest.raises(RunnerError) as e:
        resolve_sources(folder, table)
    line = str(e.value)
    assert "\n" not in line and all(s in line for s in says), line
    return line


def test_a_source_in_the_export_folder_resolves_and_reads(folder):
    table = {"w": _entry("model.onnx.data")}
    assert resolve_sources(folder, table) is None  # no checkpoint ranges
    assert read_weight(folder, "w", table["w"]) == DATA


@pytest.mark.parametrize("name", ["absolute", "dotdot", "symlink"])
def test_a_source_outside_the_export_folder_is_refused(folder, name):
    outside = folder.parent / "outside.bin"
    (folder / "link.bin").symlink_to(outside)
    file = {"absolute": str(outside), "dotdot": "../outside.bin", "symlink": "link.bin"}[name]
    entry = _entry(file)  # its sha256 matches the outside file: crafted
    _refused(folder, {"w": entry}, "weights['w'].file", "refused")
    with pytest.raises(WeightSourceError, match="outside the export folder"):
        read_weight(folder, "w", entry)  # the read itself is confined too


def test_a_fifo_source_is_refused_without_waiting(folder):
    (folder / "model.onnx.data").unlink()
    with released_fifo(folder / "model.onnx.data") as waited:
        _refused(folder, {"w": _entry("model.onnx.data")}, "is not a regular file; refused")
        with pytest.raises(WeightSourceError, match="not a regular file; refused"):
            read_weight(folder, "w", _entry("model.onnx.data"))
        assert not waited(), "the refit waited on a FIFO"


@pytest.mark.parametrize("change,says", [
    (dict(offset=-1), "weights['w'].offset = -1: must be an integer >= 0"),
    (dict(offset=True), "weights['w'].offset = True: must be an integer >= 0"),
    (dict(sha256=None), "weights['w'].sha256 = 'None': must be 64 lowercase hex digits"),
    (dict(dtype="FLOAT128"), "weights['w'].dtype = 'FLOAT128': must be one of"),
    (dict(shape="4"), "weights['w'].shape = 4: must be a list of sizes"),
    (dict(length=1 << 50), "weights['w'].length = 1125899906842624: its dtype and shape make 16 bytes"),
    (dict(shape=[1 << 48], length=1 << 50), "more than the memory available"),
    (dict(offset=8), "weights['w']: bytes 8+16 pass the end of"),
])
def test_a_malformed_table_entry_is_one_line(folder, change, says):
    entry = _entry("model.onnx.data")
    entry.update(change)
    _refused(folder, {"w": entry}, says)


@pytest.mark.parametrize("table", [[], {"w": "model.onnx.data"}, {"w": None}])
def test_a_table_of_another_shape_is_one_line(folder, table):
    _refused(folder, table, "model.engine.json")


@pytest.fixture()
def referencing(export_dir, ckpt_dir) -> Path:
    """The session's export, made to reference `ckpt_dir` (its manifest's `weight_source`, as
    `export --weights reference` writes it), with an unrecorded shard added to the checkpoint after."""
    files = [{"name": p.name, "bytes": p.stat().st_size, "sha256": sha256(p)}
             for p in (ckpt_dir / "config.json", ckpt_dir / SHARD)]
    edit_manifest(export_dir, lambda m: m.update(weight_source={"kind": "checkpoint", "path": str(ckpt_dir),
                                                                "resolved": str(ckpt_dir.resolve()), "files": files}))
    (ckpt_dir / "extra.safetensors").write_bytes((ckpt_dir / SHARD).read_bytes())
    return export_dir


def _ranged(file: str, offset: int = 0, length: int = 16, **over) -> dict:
    return {"checkpoint": True, "ranges": [{"file": file, "offset": offset, "length": length}], "length": length,
            "dtype": "FLOAT", "shape": [length // 4], "sha256": "0" * 64, **over}


def test_checkpoint_ranges_resolve_in_the_recorded_files_only(referencing, ckpt_dir):
    assert resolve_sources(referencing, {"w": _ranged(SHARD)}) == ckpt_dir.resolve()
    for file in ("extra.safetensors", "/dev/zero", "../ckpt/" + SHARD, "model.safetensors.index.json"):
        _refused(referencing, {"w": _ranged(file)}, "weights['w'].ranges[0].file", "not one of the files the export's "
                 "referenced checkpoint recorded; refused")
    size = (ckpt_dir / SHARD).stat().st_size
    _refused(referencing, {"w": _ranged(SHARD, offset=size - 8)}, f"pass the end of {ckpt_dir / SHARD}")
    _refused(referencing, {"w": _ranged(SHARD, length=1 << 40)}, "more than the memory available")
    _refused(referencing, {"w": _ranged(SHARD, ranges=[])}, "weights['w'].ranges: must be a non-empty list")
    _refused(referencing, {"w": _ranged(SHARD, ranges=[{"file": [SHARD], "offset": 0, "length": 16}])},
             "weights['w'].ranges[0].file = \"['model-00001-of-00001.safetensors']\": not one of the files")
    _refused(referencing, {"w": _ranged(SHARD, ranges=[{"file": SHARD, "offset": -4, "length": 16}])},
             "weights['w'].ranges[0].offset = -4: must be an integer >= 0")


def test_a_referenced_checkpoint_that_is_gone_is_one_line(referencing, ckpt_dir):
    (ckpt_dir / SHARD).unlink()
    _refused(referencing, {"w": _ranged(SHARD)}, "weights referenced in the checkpoint", "missing")


def test_the_table_a_build_writes_is_checked_as_it_is_read(referencing):
    """The table round-trips through model.engine.json's JSON unchanged by the checks."""
    table = json.loads(json.dumps({"w": _ranged(SHARD)}))
    assert resolve_sources(referencing, table) is not None and table == {"w": _ranged(SHARD)}
    assert os.path.exists(referencing / "manifest.json")


def test_a_build_takes_its_ranges_from_the_recorded_files_only(referencing, ckpt_dir):
    """`build-engine --strip-weights` on a referencing export (exporter/engine_weights.checkpoint_ranges) reads
    the checkpoint as the runners do: an unrecorded shard (a FIFO here; the index was not recorded either) is
    never opened, every range lies in a recorded file."""
    (ckpt_dir / "model.safetensors.index.json").unlink()
    (ckpt_dir / "extra.safetensors").unlink()
    with released_fifo(ckpt_dir / "zz.safetensors") as waited:
        folder, ranges = checkpoint_ranges(open_folder(referencing))
        assert not waited(), "the build waited on an unrecorded FIFO"
    assert folder == ckpt_dir.resolve() and ranges
    assert {r["file"] for rs in ranges.values() for r in rs} == {SHARD}
