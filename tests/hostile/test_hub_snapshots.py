"""A checkpoint in a Hugging Face hub cache (`models--ORG--NAME/snapshots/<commit>/`, every file a relative
symlink to `../../blobs/<sha256>`) is accepted by `inspect` and `export` (copying and `--weights reference`),
and confinement is kept (fileio.confined): a file may resolve into its own repository's `blobs/` and nowhere
else — not out of `models--ORG--NAME/`, not into another repository's blobs, not elsewhere inside the
repository, and not at all from a folder that is not a models snapshot. Each refusal is one line naming the
file."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from hostile_util import k3x

from k3x.checkpoint.reference import checkpoint_hash
from k3x.runtime.base import RunnerOptions
from k3x.runtime.runners import make_runner, open_folder, prefill_logits

SHARD = "model-00001-of-00001.safetensors"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def hub_layout(ckpt: Path, cache: Path, repo: str = "models--org--k3-mini") -> Path:
    """`ckpt` laid out as the hub cache keeps it; returns the snapshot folder."""
    blobs, snapshot = cache / repo / "blobs", cache / repo / "snapshots" / COMMIT
    blobs.mkdir(parents=True)
    snapshot.mkdir(parents=True)
    (cache / repo / "refs").mkdir()
    (cache / repo / "refs" / "main").write_text(COMMIT)
    for f in sorted(ckpt.iterdir()):
        digest = hashlib.sha256(f.read_bytes()).hexdigest()
        shutil.copyfile(f, blobs / digest)
        os.symlink(f"../../blobs/{digest}", snapshot / f.name)
    return snapshot


@pytest.fixture(scope="module")
def hub(built, tmp_path_factory) -> tuple[Path, Path, Path]:
    """(the snapshot, its copying pt2 export, its `--weights reference` pt2 export)."""
    root = tmp_path_factory.mktemp("hub")
    snapshot = hub_layout(built / "ckpt", root / "cache")
    for out, extra in (("copy", []), ("reference", ["--weights", "reference"])):
        code, text = k3x("export", "--checkpoint", snapshot, "--target", "pt2", "--out", root / out, *extra)
        assert code == 0, text
    return snapshot, root / "copy", root / "reference"


def _logits(folder: Path) -> torch.Tensor:
    f = open_folder(folder)
    return prefill_logits(make_runner("pt2", f, RunnerOptions()), f.config(), torch.tensor([[1, 5, 9, 3]]))


def test_inspect_and_export_accept_a_hub_snapshot(built, hub):
    snapshot, copy, _ = hub
    assert all((snapshot / f).is_symlink() for f in os.listdir(snapshot))
    code, out = k3x("inspect", "--checkpoint", snapshot)
    assert code == 0 and "params" in out, out
    manifest = json.loads((copy / "manifest.json").read_text())
    assert manifest["checkpoint"]["hash"] == checkpoint_hash(built / "ckpt")  # the same files, names and bytes
    for name in ("tokenizer.json", "tokenizer_config.json"):  # copied as files, not as links into the cache
        assert not (copy / name).is_symlink() and (copy / name).read_bytes() == (built / "ckpt" / name).read_bytes()


def test_a_reference_export_records_the_resolved_blobs(built, hub):
    snapshot, _, reference = hub
    source = json.loads((reference / "manifest.json").read_text())["weight_source"]
    assert source["path"] == str(snapshot) and source["resolved"] == str(snapshot.resolve())
    assert {f["name"] for f in source["files"]} == {"config.json", SHARD, "model.safetensors.index.json"}
    for f in source["files"]:
        blob = (snapshot / f["name"]).resolve()
        assert blob.parent.name == "blobs" and blob.name == f["sha256"]  # the hub names a blob by its sha256
        assert f["bytes"] == blob.stat().st_size
    assert torch.equal(_logits(reference), _logits(built / "export"))  # weights read through the links at load


def _relink(snapshot: Path, name: str, target: str) -> None:
    """Point `name` at `target` (a relative link), the bytes it pointed at copied there first."""
    real = (snapshot / name).resolve()
    where = (snapshot / target).resolve() if not os.path.isabs(target) else Path(target)
    where.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(real, where)
    (snapshot / name).unlink()
    os.symlink(target, snapshot / name)


@pytest.mark.parametrize("name", ["config.json", SHARD, "tokenizer.json"])
@pytest.mark.parametrize("target", [
    "../../../outside/{name}",  # out of models--ORG--NAME/, beside it in the cache
    "../../../../outside/{name}",  # further up, out of the cache
    "../../../models--other--repo/blobs/{name}",  # another repository's blobs
    "../../refs/{name}",  # inside the repository, but not a blob
    "{abs}/elsewhere/{name}",  # an absolute link out of the cache
], ids=["beside", "up", "other-repo", "not-blobs", "absolute"])
def test_a_link_out_of_the_repositorys_blobs_is_refused(built, tmp_path, name, target):
    snapshot = hub_layout(built / "ckpt", tmp_path / "cache")
    _relink(snapshot, name, target.format(name=name, abs=tmp_path))
    for args in (["inspect", "--checkpoint", snapshot],
                 ["export", "--checkpoint", snapshot, "--target", "pt2", "--weights", "reference",
                  "--out", tmp_path / "x"]):
        if args[0] == "inspect" and name != "config.json":
            continue  # inspect reads config.json only
        code, out = k3x(*args)
        errors = [line for line in out.splitlines() if line.startswith("error")]  # progress lines aside
        assert code == 1 and len(errors) == 1, out
        assert f"{snapshot / name}: resolves to" in errors[0] and errors[0].endswith("refused"), out
    assert not (tmp_path / "x").exists()


def test_blobs_count_only_in_a_models_snapshot(built, tmp_path):
    snapshot = hub_layout(built / "ckpt", tmp_path / "cache", repo="datasets--org--k3-mini")
    code, out = k3x("inspect", "--checkpoint", snapshot)
    assert code == 1 and f"{snapshot / 'config.json'}: resolves to" in out, out
