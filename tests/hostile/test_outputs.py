"""Hostile output paths: every file k3x writes where the user named it (`run --json`, `verify --json`,
`--save-state`, `logits --out`) follows one rule (fileio.write_output): an existing path must be a regular
file; a FIFO, a device, a folder, /dev/fd/N, one of the command's inputs, an export's manifest or a file it
lists is refused in one line before any work, and left as it was; a missing folder or an empty name is one
line; `--json -` streams the records to standard output. (Not /dev/null itself: the suite may run as root,
where the old rule replaced it; a null device made in the test's folder stands in for it.)"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest
from hostile_util import cli, k3x

from k3x.cli import app


def _one_line(code: int, out: str, *needles: str) -> None:
    lines = [ln for ln in out.strip().splitlines() if not ln.startswith("note: ")]
    assert code == 1 and len(lines) == 1 and lines[0].startswith("error: "), out[-800:]
    assert all(n in lines[0] for n in needles) and "CRASH" not in out, out[-800:]


def _fifo(path: Path) -> Path:
    os.mkfifo(path)
    return path


def _null_device(path: Path) -> Path:
    try:
        os.mknod(path, stat.S_IFCHR | 0o666, os.makedev(1, 3))
    except PermissionError:
        pytest.skip("no permission to make a device node here")
    return path


def _kind(path: Path) -> int:
    return stat.S_IFMT(os.lstat(path).st_mode)


def _prompts(folder: Path) -> Path:
    p = folder / "prompts.jsonl"
    p.write_text('{"prompt_ids": [1, 2, 3]}\n')
    return p


@pytest.mark.parametrize("make, needle", [
    (lambda d: _fifo(d / "fifo"), "is a FIFO"),
    (lambda d: _null_device(d / "null"), "is a character device"),
    (lambda d: (d / "dir").mkdir() or d / "dir", "is a folder"),
])
def test_json_over_something_that_is_not_a_regular_file_is_refused(serving_dir, tmp_path, make, needle):
    out = make(tmp_path)
    kind = _kind(out)
    _one_line(*k3x("run", serving_dir, "--prompts", _prompts(tmp_path), "--json", out), "--json", needle)
    assert _kind(out) == kind  # still what it was


def test_json_over_the_prompts_file_is_refused_and_the_prompts_stay(serving_dir, tmp_path):
    prompts = _prompts(tmp_path)
    _one_line(*k3x("run", serving_dir, "--prompts", prompts, "--json", prompts), "--json", "--prompts",
              "an input of this command")
    assert prompts.read_text() == '{"prompt_ids": [1, 2, 3]}\n'


@pytest.mark.parametrize("name", ["manifest.json", "model.onnx", "tokenizer.json"])
def test_json_over_an_export_file_is_refused(serving_dir, tmp_path, name):
    before = (serving_dir / name).read_bytes()
    _one_line(*k3x("run", serving_dir, "--prompts", _prompts(tmp_path), "--json", serving_dir / name), "--json")
    assert (serving_dir / name).read_bytes() == before


def test_json_over_another_exports_manifest_is_refused(serving_dir, export_dir, tmp_path):
    before = (export_dir / "manifest.json").read_bytes()
    _one_line(*k3x("run", serving_dir, "--prompts", _prompts(tmp_path), "--json", export_dir / "manifest.json"),
              "--json", "a file of the export", "its manifest")
    assert (export_dir / "manifest.json").read_bytes() == before


@pytest.mark.parametrize("out, needle", [
    ("missing/out.json", "does not exist"),
    ("", "is a folder"),  # the CLI reads an empty path as the current folder
    ("/dev/fd/0", "a device or system path"),
])
def test_json_to_no_file_is_one_line(serving_dir, tmp_path, out, needle):
    path = str(tmp_path / out) if out.startswith("missing") else out
    _one_line(*k3x("run", serving_dir, "--prompts", _prompts(tmp_path), "--json", path), "--json", needle)


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a read-only folder")
def test_json_into_a_read_only_folder_is_one_line(serving_dir, tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        _one_line(*k3x("run", serving_dir, "--prompts", _prompts(tmp_path), "--json", ro / "o.json"), "not writable")
    finally:
        ro.chmod(0o700)


def test_json_dash_streams_the_records_to_stdout(serving_dir, tmp_path):
    r = cli.invoke(app, ["run", str(serving_dir), "--backend", "pt2", "--prompts", str(_prompts(tmp_path)),
                         "--max-new-tokens", "2", "--json", "-"])
    assert r.exit_code == 0, r.output
    records = json.loads(r.stdout)  # the JSON alone on standard output
    assert [rec["index"] for rec in records] == [0] and len(records[0]["tokens"]) == 2
    assert not (Path.cwd() / "-").exists()


def test_save_state_over_a_fifo_is_refused(export_dir, tmp_path):
    fifo = _fifo(tmp_path / "state")
    _one_line(*k3x("run", export_dir, "--prompt-ids", "1,2", "--max-new-tokens", "1", "--save-state", fifo),
              "--save-state", "is a FIFO")
    assert _kind(fifo) == stat.S_IFIFO


def test_save_state_over_an_export_file_is_refused(export_dir):
    before = (export_dir / "model.pt2").read_bytes()
    _one_line(*k3x("run", export_dir, "--prompt-ids", "1,2", "--max-new-tokens", "1", "--save-state",
                   export_dir / "model.pt2"), "--save-state", "artifact pt2")
    assert (export_dir / "model.pt2").read_bytes() == before


def test_verify_json_over_a_fifo_is_refused_before_any_work(export_dir, tmp_path):
    fifo = _fifo(tmp_path / "report")
    _one_line(*k3x("verify", export_dir, "--backends", "pt2", "--json", fifo), "--json", "is a FIFO")
    assert _kind(fifo) == stat.S_IFIFO


@pytest.mark.parametrize("target", ["batch-file", "folder"])
def test_logits_out_over_its_input_or_a_folder_is_refused(export_dir, tmp_path, target):
    import numpy as np

    ids = tmp_path / "ids.npy"
    np.save(ids, np.array([[1, 2, 3]], dtype=np.int64))
    before = ids.read_bytes()
    out = ids if target == "batch-file" else tmp_path
    _one_line(*k3x("logits", "--out", out, "--backend", "pt2", "--export-dir", export_dir, "--batch-file", ids),
              "--out")
    assert ids.read_bytes() == before


def test_a_regular_file_is_still_replaced_whole(export_dir, tmp_path):
    out = tmp_path / "logits.npy"
    out.write_bytes(b"old")
    code, text = k3x("logits", "--out", out, "--backend", "pt2", "--export-dir", export_dir, "--input-ids", "1,2")
    assert code == 0, text
    assert out.read_bytes()[:6] == b"\x93NUMPY" and not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp")]
