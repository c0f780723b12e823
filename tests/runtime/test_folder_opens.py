"""An export folder is opened once per command and passed down (issue 19): every manifest read of one
`k3x run` is counted (folder/artifacts.read_manifest, under ExportFolder.open and read_parallel alike)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
from typer.testing import CliRunner

import k3x.folder.artifacts as artifacts
from k3x.cli import app
from k3x.folder.artifacts import ExportFolder
from k3x.runtime import session as sessions
from k3x.runtime.runners import RunnerOptions, make_runner
from onnx_mini_folder import mini_export


@pytest.fixture()
def reads(monkeypatch) -> Counter:
    """Manifest reads per folder while the test runs."""
    seen: Counter = Counter()
    real = artifacts.read_manifest

    def counting(path):
        seen[Path(path).resolve()] += 1
        return real(path)

    monkeypatch.setattr(artifacts, "read_manifest", counting)
    return seen


@pytest.mark.parametrize("backend", ["pt2", "ort"])
def test_an_open_folder_is_never_read_again(reads, backend):
    if backend == "ort":
        pytest.importorskip("onnxruntime")
    path = mini_export().folder  # built (and its manifest written) before counting
    reads.clear()
    folder = ExportFolder.open(path)
    assert reads == Counter({folder.path.resolve(): 1})
    options = RunnerOptions(provider="cpu")
    assert sessions.backends_of(folder, [backend]) == ([backend], [])
    assert sessions.world_to_spawn(folder) is None
    s = sessions.open_session(folder, [backend], options)
    make_runner(backend, folder, options)
    assert set(s.runners) == {backend}
    assert reads == Counter({folder.path.resolve(): 1})  # the one open above: the library read nothing again


@pytest.mark.parametrize("backend", ["pt2", "ort"])
def test_k3x_run_reads_the_manifest_once_per_library_call(reads, backend):
    """Before the folder was passed down a `k3x run` read it 9 times (pt2) / 7 times (ort): once per runner
    helper. Now each library entry point the CLI calls with a path opens it once (the CLI's own check,
    backends_of, world_to_spawn, open_session): at most 4, and 1 once the CLI passes its folder on."""
    if backend == "ort":
        pytest.importorskip("onnxruntime")
    m = mini_export()
    reads.clear()
    r = CliRunner().invoke(app, ["run", str(m.folder), "--backend", backend, "--prompt-ids", "1,2,3",
                                 "--max-new-tokens", "2", *(["--provider", "cpu"] if backend == "ort" else [])])
    assert r.exit_code == 0, r.output
    assert set(reads) == {m.folder.resolve()} and 1 <= reads[m.folder.resolve()] <= 4, reads
