"""ONNX Runtime CPU kernels for k3 ops: the op families' `ort_kernel.cc` compiled into one custom-op library.

Why: the `ort` flavor runs every k3 node as its function body (standard ops, custom_ops/<family>/onnx.py),
each op a pass over memory and many of them on one core. A family may also ship `ort_kernel.cc`: the same
op as one C++ pass, rows over ONNX Runtime's intra-op threads; and kernels of `k3x.fused` functions
(custom_ops/fused.py: standard-op chains the exporter groups, the SiTU-GLU), registered in that domain; what
they share is in custom_ops/ort_kernel.h. ONNX Runtime runs a node on a registered kernel of its domain and name
before it inlines the model's function of that name (and still inlines the nodes the library has no kernel
for), so the library is optional and an export is the same file with or without it: the function bodies stay
the portable fallback, and the kernels are checked against the references (tests/runtime/test_ort_kernels.py).

- Built by `k3x build-ort-kernels` (`build`): g++ and ONNX Runtime's C/C++ API headers, taken from
  K3X_ORT_INCLUDE (a folder holding onnxruntime_cxx_api.h) or else from Debian's libonnxruntime-dev package
  (`HEADERS`: fetched from deb.debian.org, sha256 checked; its API version 21 is served by onnxruntime-gpu
  1.31). The library needs nothing else: it gets the API from the session that loads it.
- Written to the cache, $XDG_CACHE_HOME/k3x/ort-kernels/<key>/ (default ~/.cache), key = sha256 of the
  sources and the compiler command, through a temporary name renamed into place (never half-written).
- Loaded (`library`) by CPU sessions only: the kernels are fp32 host code. K3X_ORT_KERNELS=0 turns it off.
  Loading a library runs its code: it is as trusted as the cache folder, which only its owner should write.
"""

from __future__ import annotations

import hashlib
import io
import os
import shutil
import subprocess
import tarfile
import tempfile
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from .base import RunnerError

LIBRARY = "libk3x_ort_kernels.so"
# -fno-trapping-math: without it g++ 12 if-converts no float compare-and-select, so no loop holding a clamp or a
# select (exp_approx, tanh_ratio, every softplus / sigmoid) vectorises and each ran scalar (the SiTU-GLU loop of
# the time, one thread on a Zen 3: ~20 ns an element scalar, ~6 vectorised); it changes no value, only whether a
# compare may raise an FP exception flag.
FLAGS = ("-O3", "-march=native", "-fopenmp-simd", "-fno-trapping-math", "-std=c++17", "-shared", "-fPIC",
         "-fvisibility=hidden")


@dataclass(frozen=True)
class HeaderPackage:
    url: str
    sha256: str
    folder: str  # inside the package's data archive


HEADERS = HeaderPackage(
    "http://deb.debian.org/debian/pool/main/o/onnxruntime/libonnxruntime-dev_1.21.0+dfsg-1_amd64.deb",
    "14f7d959d5deacbcf1504830d4189f91fc67382b399ed9ae9d3aa9c4050ced08", "./usr/include/onnxruntime/")

ENTRY = """#define ORT_API_MANUAL_INIT
#include <onnxruntime_cxx_api.h>
{declarations}
extern "C" __attribute__((visibility("default"))) OrtStatus* ORT_API_CALL
RegisterCustomOps(OrtSessionOptions* options, const OrtApiBase* api_base) {{
  Ort::InitApi(api_base->GetApi(ORT_API_VERSION));
  static Ort::CustomOpDomain k3{{"{domain}"}}, fused{{"{fused}"}};
  try {{
{calls}
    Ort::UnownedSessionOptions(options).Add(k3);
    Ort::UnownedSessionOptions(options).Add(fused);
  }} catch (const Ort::Exception& e) {{
    return Ort::GetApi().CreateStatus(e.GetOrtErrorCode(), e.what());
  }}
  return nullptr;
}}
"""


def _custom_ops() -> Path:
    """custom_ops/: the families' folders, and ort_kernel.h, what their kernels share (on the include path, in
    the key)."""
    return Path(__file__).resolve().parent.parent / "custom_ops"


def sources() -> dict[str, Path]:
    """family -> its ort_kernel.cc, for every registered family that has one."""
    from ..custom_ops.registry import families

    root = _custom_ops()
    return {f.name: root / f.name / "ort_kernel.cc" for f in families() if (root / f.name / "ort_kernel.cc").is_file()}


def _entry() -> str:
    from ..custom_ops.fused import FUSED_DOMAIN
    from ..plan.onnx_node import DOMAIN

    names = list(sources())
    return ENTRY.format(domain=DOMAIN, fused=FUSED_DOMAIN,
                        declarations="\n".join(f"void k3x_add_{n}(Ort::CustomOpDomain&, Ort::CustomOpDomain&);"
                                               for n in names),
                        calls="\n".join(f"    k3x_add_{n}(k3, fused);" for n in names))


def _compiler() -> str:
    cxx = os.environ.get("CXX", "g++")
    if shutil.which(cxx) is None:
        raise RunnerError(f"building the ONNX Runtime kernels needs a C++ compiler: {cxx!r} is not on PATH "
                          "(apt install g++, or set CXX)")
    return cxx


def _cache() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "k3x" / "ort-kernels"


def _cpu() -> str:
    """The CPU's instruction-set flags (-march=native code must not run on another CPU sharing the cache)."""
    try:
        return next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        import platform

        return platform.processor() or platform.machine()


def _key(cxx: str) -> str:
    """The library's cache key: its sources, the compiler command, the headers it is built against, the CPU."""
    h = hashlib.sha256(_entry().encode())
    for name, path in sorted(sources().items()):
        h.update(name.encode() + path.read_bytes())
    h.update((_custom_ops() / "ort_kernel.h").read_bytes())
    given = os.environ.get("K3X_ORT_INCLUDE")
    headers = (Path(given) / "onnxruntime_c_api.h").read_bytes() if given and Path(given).is_dir() else HEADERS.sha256
    h.update(" ".join((cxx, *FLAGS, _cpu())).encode() + (headers if isinstance(headers, bytes) else headers.encode()))
    return h.hexdigest()[:16]


def library() -> Path | None:
    """The built library for these sources, this compiler and this CPU, or None (not built, or
    K3X_ORT_KERNELS=0)."""
    if os.environ.get("K3X_ORT_KERNELS", "1") == "0" or not sources():
        return None
    try:
        path = _cache() / _key(os.environ.get("CXX", "g++")) / LIBRARY
    except OSError:  # K3X_ORT_INCLUDE without the headers: `build` names it
        return None
    return path if path.is_file() else None


def _ar_member(archive: bytes, prefix: str) -> bytes:
    """The first member of a Unix ar archive (a .deb) whose name starts with `prefix`."""
    if not archive.startswith(b"!<arch>\n"):
        raise RunnerError("not an ar archive")
    at = 8
    while at + 60 <= len(archive):
        name, size = archive[at:at + 16].decode().strip().rstrip("/"), int(archive[at + 48:at + 58])
        if name.startswith(prefix):
            return archive[at + 60:at + 60 + size]
        at += 60 + size + (size & 1)
    raise RunnerError(f"no {prefix}* member")


def _headers(progress: Callable[[str], None]) -> Path:
    """A folder holding onnxruntime_cxx_api.h: K3X_ORT_INCLUDE, or the Debian package's (cached)."""
    given = os.environ.get("K3X_ORT_INCLUDE")
    if given:
        if not (Path(given) / "onnxruntime_cxx_api.h").is_file():
            raise RunnerError(f"K3X_ORT_INCLUDE={given}: no onnxruntime_cxx_api.h there")
        return Path(given)
    folder = _cache() / f"headers-{HEADERS.sha256[:16]}"
    if (folder / "onnxruntime_cxx_api.h").is_file():
        return folder
    progress(f"fetching ONNX Runtime's API headers: {HEADERS.url}")
    try:
        with urllib.request.urlopen(HEADERS.url, timeout=60) as r:
            deb = r.read()
    except OSError as e:
        raise RunnerError(f"{HEADERS.url}: cannot fetch ({e}); set K3X_ORT_INCLUDE to a folder holding "
                          "onnxruntime_cxx_api.h") from None
    if hashlib.sha256(deb).hexdigest() != HEADERS.sha256:
        raise RunnerError(f"{HEADERS.url}: sha256 {hashlib.sha256(deb).hexdigest()} is not the pinned "
                          f"{HEADERS.sha256}; refusing it")
    try:
        with tarfile.open(fileobj=io.BytesIO(_ar_member(deb, "data.tar")), mode="r:*") as tar:
            headers = {m.name[len(HEADERS.folder):]: tar.extractfile(m).read() for m in tar.getmembers()
                       if m.isfile() and m.name.startswith(HEADERS.folder) and m.name.endswith(".h")
                       and "/" not in m.name[len(HEADERS.folder):]}
    except (RunnerError, tarfile.TarError, ValueError) as e:
        raise RunnerError(f"{HEADERS.url}: cannot read its headers ({e})") from None
    if "onnxruntime_cxx_api.h" not in headers:
        raise RunnerError(f"{HEADERS.url}: no onnxruntime_cxx_api.h in it")
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".headers-", dir=folder.parent))
    try:
        for name, data in headers.items():
            (staging / name).write_bytes(data)
        os.replace(staging, folder)  # whole or not at all; a folder another process put there first stays
    except OSError:
        if not (folder / "onnxruntime_cxx_api.h").is_file():
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return folder


def compiler_command(progress: Callable[[str], None] = lambda _: None) -> list[str]:
    """The compiler, its flags and the include folders every kernel source is built with (the headers fetched
    once, or K3X_ORT_INCLUDE checked); sources and output to append."""
    return [_compiler(), *FLAGS, f"-I{_headers(progress)}", f"-I{_custom_ops()}"]


def build(progress: Callable[[str], None] = lambda _: None) -> Path:
    """Compile the library for the current sources (no-op when it is built); returns its path."""
    if not sources():
        raise RunnerError("no op family has an ort_kernel.cc")
    command = compiler_command(progress)
    cxx = command[0]
    out = _cache() / _key(cxx) / LIBRARY
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        entry = Path(tmp) / "entry.cc"
        entry.write_text(_entry())
        target = Path(tmp) / LIBRARY
        cmd = [*command, str(entry), *map(str, sources().values()), "-o", str(target)]
        progress(f"compiling {len(sources())} ONNX Runtime kernel(s) ({', '.join(sources())})")
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode:
            raise RunnerError(f"{cxx} failed ({r.returncode}):\n{r.stderr.strip()[-4000:]}")
        os.replace(target, out)
    return out
