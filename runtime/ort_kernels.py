"""ONNX Runtime CPU kernels for k3 ops: the op families' `ort_kernel.cc` compiled into one custom-op library.

Why: the `ort` flavor runs every k3 node as its function body (standard ops, custom_ops/<family>/onnx.py),
each op a pass over memory and many of them on one core. A family may also ship `ort_kernel.cc`: the same
op as one C++ pass, rows over ONNX Runtime's intra-op threads; and kernels of `k3x.fused` functions
(custom_ops/fused.py: standard-op chains the exporter groups, the SiTU-GLU), registered in that domain; what
they share is in custom_ops/ort_kernel.h (and what two families' kernels share, in a header of the owning
family: kda/ort_recurrence.h). ONNX Runtime runs a node on a registered kernel of its domain and name
before it inlines the model's function of that name (and still inlines the nodes the library has no kernel
for), so the library is optional and an export is the same file with or without it: the function bodies stay
the portable fallback, and the kernels are checked against the references (tests/runtime/test_ort_kernels.py).

- Built by `k3x build-ort-kernels` (`build`): g++ and ONNX Runtime's C/C++ API headers as a package manager
  installed them (`headers`): K3X_ORT_INCLUDE (a folder holding onnxruntime_cxx_api.h), else the compiler's
  standard include folders (CPLUS_INCLUDE_PATH, CPATH, <python prefix>/include, /usr/local/include,
  /usr/include, each also with onnxruntime/: Debian's and Ubuntu's libonnxruntime-dev put them in
  /usr/include/onnxruntime), else an installed Python package that ships them (site-packages/<package>/include
  or .../capi); nothing is downloaded. Their ORT_API_VERSION must be one the installed onnxruntime serves (the
  library asks the session for that version). The library needs nothing else: it gets the API from the session
  that loads it.
- Cached by key (runtime/kernel_cache.py: where, and when a cached library is trusted), key = sha256 of the
  sources and every header under custom_ops/, the compiler's version and the target -march=native resolved to on this CPU (`-Q --help=target`:
  a cache shared by machines of two CPU kinds holds one library for each), and the headers.
- Loaded (`library`) by CPU sessions only: the kernels are fp32 host code. K3X_ORT_KERNELS=0 turns it off.
  Loading a library runs its code: only a library that is the user's own and what was built is loaded.
"""

from __future__ import annotations

import functools
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Callable, Iterator

from .base import RunnerError
from .kernel_cache import LIBRARY, check, prepare, store, trusted
# -fno-trapping-math: without it g++ 12 if-converts no float compare-and-select, so no loop holding a clamp or a
# select (exp_approx, tanh_ratio, every softplus / sigmoid) vectorises and each ran scalar (the SiTU-GLU loop of
# the time, one thread on a Zen 3: ~20 ns an element scalar, ~6 vectorised); it changes no value, only whether a
# compare may raise an FP exception flag.
FLAGS = ("-O3", "-march=native", "-fopenmp-simd", "-fno-trapping-math", "-std=c++17", "-shared", "-fPIC",
         "-fvisibility=hidden")


HEADER = "onnxruntime_cxx_api.h"
INSTALL = ("apt install libonnxruntime-dev (Debian 13 and later; on Debian 12 `bash scripts/ort_headers.sh` in a k3x "
           "checkout copies its headers into .venv/include), or set K3X_ORT_INCLUDE to a folder holding "
           "onnxruntime_cxx_api.h")

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


def installed_api() -> int | None:
    """The newest ORT_API_VERSION the installed onnxruntime serves (1.N serves N), or None when unknown."""
    try:
        import onnxruntime

        return int(onnxruntime.__version__.split(".")[1])
    except (ImportError, IndexError, ValueError):
        return None


def include_folders() -> Iterator[Path]:
    """Where ONNX Runtime's headers are looked for, in order (K3X_ORT_INCLUDE aside): the compiler's standard
    include folders, each also with onnxruntime/, then the include folders of installed Python packages."""
    bases = [Path(p) for var in ("CPLUS_INCLUDE_PATH", "CPATH") for p in os.environ.get(var, "").split(":")
             if os.path.isabs(p)]
    for base in (*bases, Path(sys.prefix) / "include", Path("/usr/local/include"), Path("/usr/include")):
        yield from (base / "onnxruntime", base)
    import sysconfig

    for site in dict.fromkeys(sysconfig.get_paths()[k] for k in ("purelib", "platlib")):
        for pattern in ("*/include", "*/include/onnxruntime", "*/capi", "*/*/include"):
            yield from sorted(p for p in Path(site).glob(pattern) if p.is_dir())


def headers() -> Path:
    """The folder holding onnxruntime_cxx_api.h (module docstring), its API version served by the installed
    onnxruntime; RunnerError in one line saying what to install."""
    given = os.environ.get("K3X_ORT_INCLUDE")
    if given:
        if not (Path(given) / HEADER).is_file():
            raise RunnerError(f"K3X_ORT_INCLUDE={given}: no {HEADER} there: {INSTALL}")
        found = Path(given)
    else:
        found = next((f for f in include_folders() if (f / HEADER).is_file()), None)
        if found is None:
            raise RunnerError(f"ONNX Runtime's C/C++ API headers ({HEADER}) are in no standard include folder "
                              f"(/usr/include/onnxruntime, ...) nor installed Python package: {INSTALL}")
    try:
        version = re.search(rb"^#define ORT_API_VERSION (\d+)", (found / "onnxruntime_c_api.h").read_bytes(), re.M)
    except OSError:
        version = None
    if version is None:
        raise RunnerError(f"{found}: no onnxruntime_c_api.h with its ORT_API_VERSION beside {HEADER}")
    served = installed_api()
    if served is not None and int(version[1]) > served:
        raise RunnerError(f"{found}: ONNX Runtime's headers of API version {int(version[1])}, newer than the "
                          f"installed onnxruntime 1.{served} serves; install headers of 1.{served} or older")
    return found


@functools.lru_cache(maxsize=8)
def resolved_target(cxx: str) -> bytes:
    """The compiler's version and the target FLAGS (-march=native) resolve to on this CPU: every -m option
    as g++ settles it (`-Q --help=target`). Code built for one CPU must not run on another sharing the cache.
    Memoised per process (the CPU does not change under it; `resolved_target.cache_clear()` forgets)."""
    out = b""
    for args in (["--version"], [*FLAGS, "-Q", "--help=target"]):
        r = subprocess.run([cxx, *args], capture_output=True, stdin=subprocess.DEVNULL)
        if r.returncode:
            raise RunnerError(f"{cxx} {' '.join(args)} failed ({r.returncode})")
        out += r.stdout
    return out


def _key(cxx: str, include: Path) -> str:
    """The library's cache key: its sources, the compiler and its resolved target, the headers' API."""
    h = hashlib.sha256(_entry().encode())
    for name, path in sorted(sources().items()):
        h.update(name.encode() + path.read_bytes())
    for header in sorted(_custom_ops().rglob("*.h")):  # ort_kernel.h and a family's own (kda/ort_recurrence.h)
        h.update(header.relative_to(_custom_ops()).as_posix().encode() + header.read_bytes())
    h.update(" ".join((cxx, *FLAGS)).encode() + resolved_target(shutil.which(cxx) or cxx))
    h.update((include / "onnxruntime_c_api.h").read_bytes())
    return h.hexdigest()[:16]


def library() -> Path | None:
    """The built library for these sources, this compiler, this CPU and these headers, when it is trusted
    (runtime/kernel_cache.py; a line on stderr when it is not), or None (not built, no compiler or headers, or
    K3X_ORT_KERNELS=0)."""
    if os.environ.get("K3X_ORT_KERNELS", "1") == "0" or not sources():
        return None
    cxx = os.environ.get("CXX", "g++")
    if shutil.which(cxx) is None:
        return None
    try:
        key = _key(cxx, headers())
    except (RunnerError, OSError):  # no headers, or a compiler that does not run: `build` names it
        return None
    return trusted(key)


def compiler_command(include: Path | None = None) -> list[str]:
    """The compiler, its flags and the include folders every kernel source is built with (`include`, else the
    `headers` found); sources and output to append."""
    return [_compiler(), *FLAGS, f"-I{include or headers()}", f"-I{_custom_ops()}"]


def build(progress: Callable[[str], None] = lambda _: None) -> Path:
    """Compile the library for the current sources (no-op when a trusted build is cached; an untrusted one is
    rebuilt, said by `progress`); returns its path."""
    if not sources():
        raise RunnerError("no op family has an ort_kernel.cc")
    include = headers()
    command = compiler_command(include)
    cxx, key = command[0], _key(command[0], include)
    folder = prepare(key, progress)
    if os.path.lexists(folder / LIBRARY):
        try:
            return check(key)
        except RunnerError as e:
            progress(f"{e}; rebuilding it")
    with tempfile.TemporaryDirectory(dir=folder) as tmp:
        entry = Path(tmp) / "entry.cc"
        entry.write_text(_entry())
        target = Path(tmp) / LIBRARY
        cmd = [*command, str(entry), *map(str, sources().values()), "-o", str(target)]
        progress(f"compiling {len(sources())} ONNX Runtime kernel(s) ({', '.join(sources())})")
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode:
            raise RunnerError(f"{cxx} failed ({r.returncode}):\n{r.stderr.strip()[-4000:]}")
        return store(target, key)
