"""Nothing is read through a symlink out of its folder, nothing of an export is read unchecked, nothing of
the user's is lost (issue 18 items 2-4):
- checkpoint files of every kind (tokenizer files, template, generation config, config.json, the index)
  symlinked to a file elsewhere are refused, and their content never reaches the export; copies never get
  wider permissions than their source;
- an export's tokenizer files are hash-checked and confined, and only the ones its manifest lists are read;
- `build-engine` checks `model.trt.onnx` (+ data) against the manifest and refuses a symlink out of the folder;
- a rank folder must be that rank: a symlink to, or a copy of, another rank's folder is refused;
- re-export and `build-engine` refuse (one line naming the file) instead of deleting or overwriting a file the
  manifest does not list.
Every refusal is checked to happen before anything is loaded or spawned, so these tests stay fast."""

from __future__ import annotations

import json
import os
import shutil
import stat
from pathlib import Path

import pytest
from hostile_util import edit_manifest, k3x, rehash

from k3x.checkpoint.files import INDEX
from k3x.exporter.ranks import read_parallel
from k3x.folder.artifacts import ExportFolder, update_manifest

SECRET = "TOP-SECRET-7f3a payload marker"
FAST = ("--no-weights", "--target", "pt2")  # copies the tokenizer, traces on meta: a few seconds


def _errors(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("error")]


def _refused(code: int, text: str, *words: str) -> None:
    assert code == 1 and len(_errors(text)) == 1 and "Traceback" not in text and "CRASH" not in text, text
    assert all(w in text for w in words), text


def _secret(tmp_path: Path) -> Path:
    p = tmp_path / "private" / "secret.txt"
    p.parent.mkdir()
    p.write_text(SECRET)
    p.chmod(0o600)
    return p


def _assert_no_secret(*roots: Path) -> None:
    for root in roots:
        for p in [root] if root.is_file() else root.rglob("*") if root.exists() else []:
            if p.is_file() and not p.is_symlink():
                assert SECRET.encode() not in p.read_bytes(), f"{p} holds the private file's content"


def _tree(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


# --- 1. checkpoint files: confined, copies never widened ----------------------------------------------

@pytest.mark.parametrize("name", ["chat_template.jinja", "tokenizer.json", "tokenizer_config.json",
                                  "generation_config.json", "tiktoken.model", "special_tokens_map.json"])
def test_export_refuses_a_tokenizer_file_symlinked_out_of_the_checkpoint(ckpt_dir, tmp_path, name):
    secret = _secret(tmp_path)
    (ckpt_dir / name).unlink(missing_ok=True)
    os.symlink(secret, ckpt_dir / name)
    out = tmp_path / "out"
    code, text = k3x("export", "--checkpoint", ckpt_dir, *FAST, "--out", out)
    _refused(code, text, name, "outside the checkpoint folder")
    assert "[model]" not in text and "[trace]" not in text, text  # refused with the job, before the model is built
    assert not out.exists()
    _assert_no_secret(tmp_path / "out", *tmp_path.glob(".out.*"))


@pytest.mark.parametrize("name", ["config.json", INDEX])
def test_a_config_or_index_symlinked_out_of_the_checkpoint_is_refused(ckpt_dir, tmp_path, name):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    shutil.move(ckpt_dir / name, elsewhere / name)  # the same bytes: only the symlink is wrong
    os.symlink(elsewhere / name, ckpt_dir / name)
    code, text = k3x("export", "--checkpoint", ckpt_dir, *FAST, "--out", tmp_path / "out")
    _refused(code, text, name, "outside the checkpoint folder")
    code, text = k3x("generate", "--checkpoint", ckpt_dir, "--max-new-tokens", "1")
    _refused(code, text, name, "outside")


def test_generate_never_reads_a_chat_template_symlinked_elsewhere(ckpt_dir, tmp_path):
    os.symlink(_secret(tmp_path), ckpt_dir / "chat_template.jinja")
    code, text = k3x("generate", "--checkpoint", ckpt_dir, "--prompt", "hi", "--chat", "--max-new-tokens", "1")
    _refused(code, text, "chat_template.jinja", "outside")
    assert SECRET not in text


def test_copied_tokenizer_files_keep_a_private_mode(ckpt_dir, tmp_path):
    (ckpt_dir / "tokenizer_config.json").chmod(0o600)
    (ckpt_dir / "tokenizer.json").chmod(0o640)
    out = tmp_path / "out"
    code, text = k3x("export", "--checkpoint", ckpt_dir, *FAST, "--out", out)
    assert code == 0, text
    assert stat.S_IMODE((out / "tokenizer_config.json").stat().st_mode) & 0o077 == 0  # never world-readable
    assert stat.S_IMODE((out / "tokenizer.json").stat().st_mode) & 0o007 == 0
    gen = stat.S_IMODE((out / "generation_config.json").stat().st_mode)
    assert gen & stat.S_IRUSR and gen & ~(0o666 & ~_umask()) == 0  # the export's rule, no wider


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


# --- 2. what a command reads from an export is what the manifest lists --------------------------------

def _run_prompt(export_dir: Path, *extra: str):
    return k3x("run", export_dir, "--backend", "pt2", "--prompt", "hello", "--max-new-tokens", "1", *extra)


def test_a_changed_tokenizer_file_in_an_export_is_refused(export_dir):
    cfg = json.loads((export_dir / "tokenizer_config.json").read_text())
    cfg["chat_template"] = "{{ 'injected' }}"
    (export_dir / "tokenizer_config.json").write_text(json.dumps(cfg))
    code, text = _run_prompt(export_dir, "--chat")
    _refused(code, text, "tokenizer_config.json", "changed since the export")


def test_a_tokenizer_file_the_manifest_does_not_list_is_refused(export_dir):
    (export_dir / "chat_template.jinja").write_text("{{ 'planted' }}")
    code, text = _run_prompt(export_dir, "--chat")
    _refused(code, text, "chat_template.jinja", "manifest lists")


def test_an_export_tokenizer_symlinked_out_of_the_folder_is_refused(export_dir, tmp_path):
    """Same bytes (the hash matches): only the confinement can tell."""
    moved = tmp_path / "tokenizer.json"
    shutil.move(export_dir / "tokenizer.json", moved)
    os.symlink(moved, export_dir / "tokenizer.json")
    code, text = _run_prompt(export_dir)
    _refused(code, text, "tokenizer.json", "outside the export folder")


def _flip_last_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    path.write_bytes(bytes(data))


def _trt_files(export_dir: Path) -> list[str]:
    return [f["path"] for f in ExportFolder.open(export_dir).manifest["artifacts"]["onnx"]["files"]
            if f["path"].startswith("model.trt.onnx")]


@pytest.mark.parametrize("which", ["graph", "data"])
def test_build_engine_refuses_a_tampered_trt_onnx(export_dir, which):
    names = _trt_files(export_dir)
    target = export_dir / (names[0] if which == "graph" or len(names) == 1 else names[1])
    _flip_last_byte(target)
    code, text = k3x("build-engine", export_dir, "--runtime", "trt")
    _refused(code, text, target.name, "changed since the export")
    assert not (export_dir / "model.engine").exists() and "trt" not in ExportFolder.open(export_dir).manifest["artifacts"]


def test_build_engine_refuses_a_trt_onnx_symlinked_out_of_the_folder(export_dir, tmp_path):
    moved = tmp_path / "model.trt.onnx"
    shutil.move(export_dir / "model.trt.onnx", moved)
    os.symlink(moved, export_dir / "model.trt.onnx")
    code, text = k3x("build-engine", export_dir, "--runtime", "trt")
    _refused(code, text, "model.trt.onnx", "outside the export folder")
    assert not (export_dir / "model.engine").exists()


@pytest.fixture(scope="module")
def sharded(built, tmp_path_factory) -> Path:
    """One EP=2 rank export (pt2, weights) of the suite's checkpoint for this module."""
    out = tmp_path_factory.mktemp("sharded") / "tp2"
    code, text = k3x("export", "--checkpoint", built / "ckpt", "--ep", "2", "--target", "pt2", "--out", out)
    assert code == 0, text
    return out


@pytest.fixture()
def sharded_dir(sharded, tmp_path) -> Path:
    out = tmp_path / "tp2"
    shutil.copytree(sharded, out, symlinks=True)
    return out


def _run_ranks(export_dir: Path):
    return k3x("run", export_dir, "--backend", "pt2", "--prompt-ids", "1,2", "--max-new-tokens", "1")


def test_an_untouched_rank_export_reads_back(sharded_dir):
    data, plan = read_parallel(sharded_dir)
    assert plan.world == 2 and [r["dir"] for r in data["parallel"]["ranks"]] == ["rank-000", "rank-001"]


def test_a_rank_folder_symlinked_to_another_rank_is_refused(sharded_dir):
    shutil.rmtree(sharded_dir / "rank-001")
    os.symlink("rank-000", sharded_dir / "rank-001")
    _refused(*_run_ranks(sharded_dir), "rank-001", "symlink")


def test_a_rank_folder_that_is_a_copy_of_another_rank_is_refused(sharded_dir):
    shutil.rmtree(sharded_dir / "rank-001")
    shutil.copytree(sharded_dir / "rank-000", sharded_dir / "rank-001")
    _refused(*_run_ranks(sharded_dir), "rank-001", "rank 1")


def test_a_copied_rank_with_a_rewritten_top_manifest_is_still_refused(sharded_dir):
    """The attacker also records rank 0's hashes for rank 1: the rank folder's program says rank 0."""
    shutil.rmtree(sharded_dir / "rank-001")
    shutil.copytree(sharded_dir / "rank-000", sharded_dir / "rank-001")

    def as_rank0(m):
        r0, r1 = m["parallel"]["ranks"]
        r1["files"] = [{**f, "path": f["path"].replace("rank-000", "rank-001")} for f in r0["files"]]
    edit_manifest(sharded_dir, as_rank0)
    _refused(*_run_ranks(sharded_dir), "rank-001", "rank 0's, not rank 1's")


def test_a_rank_file_differing_from_the_top_manifest_is_refused(sharded_dir):
    """The rank folder's own manifest is rehashed to match a swapped file; the top manifest still knows."""
    _flip_last_byte(sharded_dir / "rank-001" / "model.pt2")
    rehash(sharded_dir / "rank-001", "pt2")
    _refused(*_run_ranks(sharded_dir), "rank-001", "differ")


# --- 3. an export replaces only what its manifest lists -----------------------------------------------

@pytest.mark.parametrize("name", ["notes.txt", "model.engine", "mine/thesis.tex"])
def test_reexport_refuses_a_folder_holding_a_users_file(export_dir, name):
    (export_dir / name).parent.mkdir(exist_ok=True)
    (export_dir / name).write_text("years of work")
    before = _tree(export_dir)
    code, text = k3x("export", "--preset", "k3-mini", *FAST, "--out", export_dir)
    _refused(code, text, name.split("/")[0], "not listed")
    assert _tree(export_dir) == before
    assert not list(export_dir.parent.glob(f".{export_dir.name}.k3x-*-*"))


def test_reexport_replaces_listed_files_and_rank_folders(export_dir, sharded_dir):
    (export_dir / "model.engine").write_bytes(b"an engine k3x built")
    update_manifest(export_dir, "trt", ["model.engine"])  # listed: k3x's to replace
    for out, listed in ((export_dir, "model.engine, model.genai.onnx, model.onnx"), (sharded_dir, "rank-000/")):
        code, text = k3x("export", "--preset", "k3-mini", *FAST, "--out", out)
        assert code == 0, text
        assert sorted(os.listdir(out)) == ["manifest.json", "model.pt2"]
        replaced = [line for line in text.splitlines() if line.startswith("replaced in ")]  # one line says what went
        assert len(replaced) == 1 and replaced[0].startswith(f"replaced in {out}: ") and listed in replaced[0], text


def test_reexport_refuses_a_users_file_inside_a_rank_folder(sharded_dir):
    (sharded_dir / "rank-001" / "notes.txt").write_text("keep me")
    code, text = k3x("export", "--preset", "k3-mini", *FAST, "--out", sharded_dir)
    _refused(code, text, "rank-001/notes.txt", "not listed")
    assert (sharded_dir / "rank-001" / "notes.txt").read_text() == "keep me"


@pytest.mark.parametrize("name", ["model.engine", "model.engine.json", "timing.cache"])
def test_build_engine_never_overwrites_a_users_file(export_dir, name):
    (export_dir / name).write_text("my own")
    code, text = k3x("build-engine", export_dir, "--runtime", "trt")
    _refused(code, text, name, "manifest lists", "refusing to overwrite")
    assert (export_dir / name).read_text() == "my own"
