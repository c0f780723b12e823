"""`k3x export --weights reference`: the runners read exactly the checkpoint files the manifest recorded, each
opened once and loaded from the bytes that were hashed (checkpoint/recorded.py). An index and a shard added
after the export, an unrecorded FIFO shard, and a shard swapped between the sha256 check and the load were
read, waited on and run before."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from hostile_util import edit_manifest, k3x, released_fifo
from safetensors.torch import load_file, save_file

from k3x.fileio import sha256
from k3x.runtime.base import RunnerError
from k3x.runtime.referenced import referenced_weights
from k3x.runtime.runners import open_folder

SHARD = "model-00001-of-00001.safetensors"
INDEX = "model.safetensors.index.json"
RUN = ("--backend", "pt2", "--prompt-ids", "3,1,4,1,5", "--max-new-tokens", "4")


@pytest.fixture(scope="module")
def reference(built, tmp_path_factory) -> tuple[Path, Path]:
    """(the pristine checkpoint: the session's, without its index; the export referencing `ckpt` beside it)."""
    root = tmp_path_factory.mktemp("referenced")
    shutil.copytree(built / "ckpt", root / "pristine")
    (root / "pristine" / INDEX).unlink()  # one shard, no index: the loader takes every *.safetensors
    shutil.copytree(root / "pristine", root / "ckpt")
    code, out = k3x("export", "--checkpoint", root / "ckpt", "--target", "pt2", "--weights", "reference",
                    "--out", root / "export")
    assert code == 0, out
    return root / "pristine", root / "export"


@pytest.fixture()
def ckpt(reference) -> Path:
    """The referenced checkpoint, as exported, for this test to change."""
    folder = reference[1].parent / "ckpt"
    shutil.rmtree(folder)
    shutil.copytree(reference[0], folder)
    return folder


def _other_weights(shard: Path, out: Path) -> Path:
    """The shard with lm_head negated: same names, shapes and size, other tokens."""
    tensors = load_file(shard)
    (head,) = [k for k in tensors if k.endswith("lm_head.weight")]  # as stored: language_model.lm_head.weight
    tensors[head] = -tensors[head]
    save_file(tensors, out, metadata={"format": "pt"})
    assert out.stat().st_size == shard.stat().st_size
    return out


def _runs_the_recorded_weights(reference) -> bool:
    """Whether the runners' weights (runtime/referenced.py, what pt2 and ORT load) are the recorded ones."""
    weights = referenced_weights(open_folder(reference[1]))
    return torch.equal(weights["lm_head.weight"], load_file(reference[0] / SHARD)["language_model.lm_head.weight"])


def test_an_index_and_a_shard_added_after_the_export_are_not_read(reference, ckpt):
    _other_weights(ckpt / SHARD, ckpt / "model-00002-of-00002.safetensors")
    names = load_file(ckpt / SHARD).keys()
    (ckpt / INDEX).write_text(json.dumps({"weight_map": {k: "model-00002-of-00002.safetensors" for k in names}}))
    assert _runs_the_recorded_weights(reference)


def test_an_unrecorded_fifo_shard_is_never_opened(reference, ckpt):
    with released_fifo(ckpt / "model-zz.safetensors") as waited:
        try:
            assert _runs_the_recorded_weights(reference)
        finally:
            assert not waited(), "the loader waited on an unrecorded FIFO"


def _rename(swap: Path, shard: Path) -> None:
    os.replace(swap, shard)


def _overwrite(swap: Path, shard: Path) -> None:
    with open(shard, "r+b") as f:
        f.write(swap.read_bytes())


@pytest.mark.parametrize("replace", [_rename, _overwrite])
def test_a_shard_swapped_after_its_sha256_check_does_not_run(reference, ckpt, monkeypatch, replace):
    """The recorded shard is replaced (same size, other weights; renamed over it, or written in place) the
    moment its sha256 has been taken: what is loaded is what was hashed, or the load is refused."""
    recorded = hashlib.sha256((ckpt / SHARD).read_bytes()).hexdigest()
    swap = _other_weights(ckpt / SHARD, ckpt.parent / "swap.safetensors")
    real, swapped = hashlib.sha256, []

    class SwapAfterHashing:
        def __init__(self, data: bytes = b"", **kw) -> None:
            self.h = real(data, **kw)

        def __getattr__(self, name):
            return getattr(self.h, name)

        def hexdigest(self) -> str:
            digest = self.h.hexdigest()
            if digest == recorded and not swapped:
                replace(swap, ckpt / SHARD)
                swapped.append(True)
            return digest

    monkeypatch.setattr(hashlib, "sha256", SwapAfterHashing)
    try:
        outcome = "the recorded weights" if _runs_the_recorded_weights(reference) else "other weights"
    except RunnerError as e:
        outcome = str(e)
    monkeypatch.undo()
    assert swapped, "the shard was never hashed"
    if replace is _rename:  # the file that was opened and hashed is loaded
        assert outcome == "the recorded weights", outcome
    else:  # the bytes changed under the mapping: seen by the end of the load
        assert f"{ckpt / SHARD}: changed while it was being loaded; refused" in outcome, outcome


def test_a_recorded_index_naming_an_unrecorded_shard_is_refused(reference, ckpt):
    """A manifest that records an index (with its size and sha256) naming a shard it does not record: the
    shard is not read; the run is refused in one line."""
    other = "model-00002-of-00002.safetensors"
    _other_weights(ckpt / SHARD, ckpt / other)
    index = ckpt / INDEX
    index.write_text(json.dumps({"weight_map": {k: other for k in load_file(ckpt / SHARD).keys()}}))
    export = ckpt.parent / "edited"
    shutil.rmtree(export, ignore_errors=True)
    shutil.copytree(reference[1], export)
    edit_manifest(export, lambda m: m["weight_source"]["files"].append(
        {"name": INDEX, "bytes": index.stat().st_size, "sha256": sha256(index)}))
    code, out = k3x("run", export, *RUN)
    assert code == 1 and out.strip().count("\n") == 0 and "Traceback" not in out, out
    assert f"{INDEX}: names {other!r}, a file the export did not record; refused" in out, out
