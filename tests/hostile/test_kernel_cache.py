"""The ONNX Runtime kernel library's cache (runtime/kernel_cache.py, runtime/ort_kernels.py) is trusted only when
it is the user's own: a library planted there, a folder or file others may write, another owner, bytes that are
not the ones recorded at build: each refused in one line, never loaded (a planted library's constructor would
write a marker file), and rebuilt by `build-ort-kernels`, which never reports a planted library as built. A
relative XDG_CACHE_HOME is ignored; missing headers are one line naming the package to install.

Hermetic and fast: a stand-in compiler (`cxx`) answers the version and target queries and "compiles" by copying
a tiny library built once here; the headers are a stand-in folder (`K3X_ORT_INCLUDE`) of the right API version."""

from __future__ import annotations

import hashlib
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from hostile_util import k3x
from onnx import TensorProto, helper

from k3x.runtime import ort_kernels
from k3x.runtime.ort_kernels import library

CONSTRUCTOR = r"""#include <cstdio>
#include <cstdlib>
__attribute__((constructor)) static void planted() {
  const char* marker = std::getenv("K3X_TEST_MARKER");
  if (FILE* f = marker ? std::fopen(marker, "w") : nullptr) { std::fputs("ran", f); std::fclose(f); }
}
"""


@pytest.fixture(scope="session")
def libraries(tmp_path_factory) -> dict[str, Path]:
    """A harmless library (what the stand-in compiler produces) and a planted one whose constructor writes the
    file named by K3X_TEST_MARKER."""
    if shutil.which("g++") is None:
        pytest.skip("no g++")
    root = tmp_path_factory.mktemp("libs")
    (root / "good.cc").write_text('extern "C" int k3x_test_good() { return 1; }\n')
    (root / "planted.cc").write_text(CONSTRUCTOR)
    for name in ("good", "planted"):
        subprocess.run(["g++", "-shared", "-fPIC", "-o", str(root / f"{name}.so"), str(root / f"{name}.cc")],
                       check=True)
    loaded = root / "loaded"  # the control: opening the planted library does write its marker
    subprocess.run([sys.executable, "-c", f"import ctypes; ctypes.CDLL({str(root / 'planted.so')!r})"], check=True,
                   env={**os.environ, "K3X_TEST_MARKER": str(loaded)})
    assert loaded.read_text() == "ran"
    return {"good": root / "good.so", "planted": root / "planted.so"}


@pytest.fixture()
def cache(libraries, tmp_path, monkeypatch) -> Path:
    """A fresh XDG_CACHE_HOME, the stand-in compiler as CXX (its -march from K3X_TEST_MARCH), stand-in headers;
    returns the cache folder."""
    cxx = tmp_path / "cxx"
    cxx.write_text(f"""#!/bin/sh
case " $* " in
  *" --version "*) echo "stand-in c++ 1" ;;
  *" --help=target "*) echo "  -march=  ${{K3X_TEST_MARCH:-cpu-a}}" ;;
  *) prev=; for a; do [ "$prev" = -o ] && cp {libraries['good']} "$a"; prev=$a; done ;;
esac
""")
    cxx.chmod(0o755)
    include = tmp_path / "include"
    include.mkdir()
    (include / "onnxruntime_cxx_api.h").write_text("")
    (include / "onnxruntime_c_api.h").write_text("#define ORT_API_VERSION 21\n")
    monkeypatch.setenv("CXX", str(cxx))
    monkeypatch.setenv("K3X_ORT_INCLUDE", str(include))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setenv("K3X_TEST_MARKER", str(tmp_path / "marker"))
    monkeypatch.delenv("K3X_ORT_KERNELS", raising=False)
    return tmp_path / "cache"


def _build() -> Path:
    code, out = k3x("build-ort-kernels")
    assert code == 0, out
    return Path(out.strip().splitlines()[-1].split(": kernels of")[0])


def _cpu_session(tmp_path: Path):
    """A CPU session opened the way every k3x ONNX Runtime runner opens one (runtime/ort_runner.py)."""
    from k3x.runtime.ort_runner import ort_session

    graph = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])])
    model = tmp_path / "identity.onnx"
    model.write_bytes(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)],
                                        ir_version=10).SerializeToString())
    return ort_session(model, provider="cpu")


def test_a_planted_library_never_runs_and_build_replaces_it(cache, libraries, tmp_path, capsys):
    built = _build()
    assert library() == built
    shutil.copy(libraries["planted"], built)  # the user's own file mode and owner: only its bytes differ
    assert library() is None
    assert f"{built}: its sha256 is not the one recorded at build" in capsys.readouterr().err
    try:
        _cpu_session(tmp_path)
    except Exception:  # noqa: BLE001 - whatever ONNX Runtime says of it, the constructor must not have run
        pass
    code, out = k3x("build-ort-kernels")
    assert code == 0 and "rebuilding it" in out, out
    assert built.read_bytes() == libraries["good"].read_bytes()
    assert not (tmp_path / "marker").exists()
    assert library() == built


@pytest.mark.parametrize("what", ["k3x", "ort-kernels", "key", "library", "record"])
def test_what_others_may_write_is_refused_then_tightened_or_rebuilt(cache, what, capsys):
    built = _build()
    path = {"k3x": cache / "k3x", "ort-kernels": cache / "k3x" / "ort-kernels", "key": built.parent,
            "library": built, "record": built.parent / (built.name + ".sha256")}[what]
    path.chmod(stat.S_IMODE(path.stat().st_mode) | 0o002)
    assert library() is None
    assert f"{path}: writable by group or others" in capsys.readouterr().err
    code, out = k3x("build-ort-kernels")
    assert code == 0 and ("made 0700" if path.is_dir() else "rebuilding it") in out, out
    assert library() == built and not path.stat().st_mode & 0o022


def test_a_library_or_folder_of_another_owner_is_refused(cache, capsys):
    if os.geteuid() != 0:
        pytest.skip("changing a file's owner needs root")
    built = _build()
    os.chown(built, 12345, -1)
    assert library() is None
    assert f"{built}: owned by uid 12345, not by this user" in capsys.readouterr().err
    os.chown(built.parent, 12345, -1)
    code, out = k3x("build-ort-kernels")
    assert code == 1 and f"{built.parent}: owned by uid 12345" in out and len(out.strip().splitlines()) == 1, out
    assert library() is None


@pytest.mark.parametrize("tamper", ["append", "record-missing", "record-wrong", "record-link", "library-link"])
def test_bytes_not_recorded_at_build_are_refused(cache, libraries, tamper, capsys):
    built = _build()
    record = built.parent / (built.name + ".sha256")
    if tamper == "append":
        with built.open("ab") as f:
            f.write(b"\0")
    elif tamper == "record-missing":
        record.unlink()
    elif tamper == "record-wrong":
        record.write_text(hashlib.sha256(b"other").hexdigest() + "\n")
    elif tamper == "record-link":  # a link to a file holding the right sha256 is still not the record
        real = record.with_name("elsewhere")
        record.rename(real)
        record.symlink_to(real)
    else:
        shutil.copy(built, built.with_name("copy.so"))
        built.unlink()
        built.symlink_to(built.with_name("copy.so"))
    assert library() is None
    assert f"{built.parent}" in capsys.readouterr().err
    code, out = k3x("build-ort-kernels")
    assert code == 0 and "rebuilding it" in out, out
    assert library() == built and built.read_bytes() == libraries["good"].read_bytes()


def test_the_cache_is_created_for_its_owner_alone(cache):
    old = os.umask(0)
    try:
        built = _build()
    finally:
        os.umask(old)
    modes = {p: stat.S_IMODE(p.stat().st_mode) for p in (cache / "k3x", cache / "k3x" / "ort-kernels", built.parent,
                                                        built, built.parent / (built.name + ".sha256"))}
    assert list(modes.values()) == [0o700, 0o700, 0o700, 0o700, 0o600], modes
    assert sorted(p.name for p in built.parent.iterdir()) == [built.name, built.name + ".sha256"]


def test_a_relative_xdg_cache_home_is_ignored(cache, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("XDG_CACHE_HOME", "relative-cache")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    built = _build()
    assert built.is_relative_to(tmp_path / "home" / ".cache" / "k3x" / "ort-kernels")
    assert not (tmp_path / "relative-cache").exists()


def test_each_cpu_kind_gets_its_own_library(cache, monkeypatch):
    """-march=native resolves per CPU: a cache shared by two kinds of machine holds one library for each."""
    first = _build()
    monkeypatch.setenv("K3X_TEST_MARCH", "cpu-b")
    ort_kernels.resolved_target.cache_clear()  # as a process on the other machine starts
    assert library() is None
    second = _build()
    assert second != first and second.is_file() and first.is_file()


def test_missing_headers_are_one_line_naming_the_package(cache, tmp_path, monkeypatch):
    empty = tmp_path / "empty"
    empty.mkdir()
    monkeypatch.setenv("K3X_ORT_INCLUDE", str(empty))
    code, out = k3x("build-ort-kernels")
    assert code == 1 and "apt install libonnxruntime-dev" in out and len(out.strip().splitlines()) == 1, out
    monkeypatch.delenv("K3X_ORT_INCLUDE")
    monkeypatch.setattr(ort_kernels, "include_folders", lambda: [empty])  # none of the standard folders holds them
    code, out = k3x("build-ort-kernels")
    assert code == 1 and "apt install libonnxruntime-dev" in out and len(out.strip().splitlines()) == 1, out
    assert library() is None
    code, out = k3x("build-ort-kernels", "--help")
    assert code == 0 and "apt install libonnxruntime-dev" in " ".join(out.replace("│", " ").split()), out


def test_headers_newer_than_the_installed_onnxruntime_are_refused(cache, monkeypatch):
    monkeypatch.setattr(ort_kernels, "installed_api", lambda: 21)
    (Path(os.environ["K3X_ORT_INCLUDE"]) / "onnxruntime_c_api.h").write_text("#define ORT_API_VERSION 22\n")
    code, out = k3x("build-ort-kernels")
    assert code == 1 and "API version 22, newer than the installed onnxruntime 1.21" in out, out


def test_headers_are_found_in_an_installed_python_package(cache, tmp_path, monkeypatch):
    """A package that ships them (site-packages/<package>/include) needs no K3X_ORT_INCLUDE."""
    import sysconfig

    site = tmp_path / "site"
    shutil.copytree(os.environ["K3X_ORT_INCLUDE"], site / "somepackage" / "include")
    real = sysconfig.get_paths
    monkeypatch.setattr(sysconfig, "get_paths", lambda *a, **k: {**real(*a, **k), "purelib": str(site),
                                                                 "platlib": str(site)})
    monkeypatch.setattr(ort_kernels.sys, "prefix", str(tmp_path / "no-prefix"))
    monkeypatch.delenv("K3X_ORT_INCLUDE")
    for var in ("CPATH", "CPLUS_INCLUDE_PATH"):
        monkeypatch.delenv(var, raising=False)
    if any((Path(p) / "onnxruntime_cxx_api.h").is_file() for p in ("/usr/include", "/usr/include/onnxruntime",
                                                                    "/usr/local/include",
                                                                    "/usr/local/include/onnxruntime")):
        pytest.skip("this machine has the headers in a standard folder, found first")
    assert ort_kernels.headers() == site / "somepackage" / "include"
