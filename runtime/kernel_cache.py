"""Where the ONNX Runtime kernel library is cached, and when a cached library is trusted.

Loading a library runs its code (its constructors run when it is opened), so a library in the cache is used
only when it is the user's own and what was built:
- The folders k3x creates, $XDG_CACHE_HOME/k3x/ort-kernels/<key>/ (XDG_CACHE_HOME only when absolute, as the
  XDG rules say; else ~/.cache), are created 0700; the library is written 0700 and, beside it, its sha256 in
  `libk3x_ort_kernels.so.sha256` (0600), each through a temporary name renamed into place.
- A library is trusted (`trusted`) when k3x/, ort-kernels/ and <key>/ and both files are owned by the user and
  writable by no one else (so no one else can replace them after the check), the files are regular files (not
  links), and the library's sha256 is the recorded one. Anything else is a line saying why; the library is then
  never handed to ONNX Runtime (`runtime/ort_kernels.library`), and `build` rebuilds it (`prepare`, `store`).
"""

from __future__ import annotations

import hashlib
import os
import stat
import sys
import tempfile
from pathlib import Path
from typing import Callable

from .base import RunnerError

LIBRARY = "libk3x_ort_kernels.so"
RECORD = LIBRARY + ".sha256"


def root() -> Path:
    """$XDG_CACHE_HOME/k3x/ort-kernels, or ~/.cache/k3x/ort-kernels (XDG_CACHE_HOME unset, empty or relative)."""
    given = os.environ.get("XDG_CACHE_HOME", "")
    return (Path(given) if os.path.isabs(given) else Path.home() / ".cache") / "k3x" / "ort-kernels"


def _folders(key: str) -> tuple[Path, ...]:
    """The folders k3x owns, outermost first: k3x/, ort-kernels/, <key>/."""
    return root().parent, root(), root() / key


def _not_own(st: os.stat_result) -> str | None:
    """Why a file or folder (its stat `st`) is not the user's own, or None."""
    if st.st_uid != os.geteuid():
        return f"owned by uid {st.st_uid}, not by this user (uid {os.geteuid()})"
    if st.st_mode & 0o022:
        return f"writable by group or others (mode {stat.S_IMODE(st.st_mode):04o})"
    return None


def _file(path: Path) -> bytes:
    """A regular file's bytes when it is the user's own (checked on the open file), or RunnerError saying why
    not."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        raise RunnerError(f"{path}: missing") from None
    except OSError:
        raise RunnerError(f"{path}: a symbolic link or unreadable") from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        why = "not a regular file" if not stat.S_ISREG(st.st_mode) else _not_own(st)
        if why:
            raise RunnerError(f"{path}: {why}")
        return f.read()


def check(key: str) -> Path:
    """The library cached under `key` when it is trusted (module docstring); RunnerError naming what is not."""
    for folder in _folders(key):
        try:
            st = os.lstat(folder)
        except FileNotFoundError:
            raise RunnerError(f"{folder}: missing") from None
        if not stat.S_ISDIR(st.st_mode):
            raise RunnerError(f"{folder}: not a folder")
        why = _not_own(st)
        if why:
            raise RunnerError(f"{folder}: {why}")
    path = root() / key / LIBRARY
    data, record = _file(path), _file(path.parent / RECORD)
    want = record.decode("ascii", "replace").split()[:1]
    if want != [hashlib.sha256(data).hexdigest()]:
        raise RunnerError(f"{path}: its sha256 is not the one recorded at build in {RECORD}")
    return path


_reported: set[str] = set()


def trusted(key: str) -> Path | None:
    """The library cached under `key`, or None: not built, or not trusted (said once per process on stderr:
    the function bodies run instead)."""
    if not os.path.lexists(root() / key / LIBRARY):
        return None
    try:
        return check(key)
    except (RunnerError, OSError) as e:
        line = f"k3x: not loading the ONNX Runtime kernel library: {e}; running the function bodies instead " \
               "(`k3x build-ort-kernels` rebuilds it)"
        if line not in _reported:
            _reported.add(line)
            print(line, file=sys.stderr)
        return None


def prepare(key: str, progress: Callable[[str], None]) -> Path:
    """The <key>/ folder, created 0700 with k3x/ and ort-kernels/ (and a missing cache folder above them); a
    folder of these owned by someone else is refused (RunnerError); one of the user's own that others may write
    is made 0700, said by `progress`."""
    missing = [p for p in (*reversed(root().parent.parents), *_folders(key)) if not os.path.lexists(p)]
    for folder in missing:
        try:
            folder.mkdir(mode=0o700)
        except FileExistsError:  # another build made it meanwhile
            pass
    for folder in _folders(key):
        st = os.lstat(folder)
        if not stat.S_ISDIR(st.st_mode):
            raise RunnerError(f"{folder}: not a folder; remove it")
        if st.st_uid != os.geteuid():
            raise RunnerError(f"{folder}: owned by uid {st.st_uid}, not by this user (uid {os.geteuid()}); "
                              "k3x builds only into its own folders: remove it")
        if stat.S_IMODE(st.st_mode) != 0o700:
            if st.st_mode & 0o077:
                progress(f"{folder}: mode {stat.S_IMODE(st.st_mode):04o} let others plant a library; made 0700")
            os.chmod(folder, 0o700)
    return root() / key


def store(built: Path, key: str) -> Path:
    """Move a freshly built library (in a temporary folder inside <key>/) into place, 0700, its sha256 recorded
    beside it (0600); each renamed into place, the record first (a reader between the two sees a mismatch, or
    no library, never a wrong library trusted)."""
    folder = root() / key
    os.chmod(built, 0o700)
    digest = hashlib.sha256(built.read_bytes()).hexdigest()
    fd, tmp = tempfile.mkstemp(prefix=f".{RECORD}-", dir=folder)  # 0600
    try:
        with os.fdopen(fd, "w") as f:
            f.write(f"{digest}  {LIBRARY}\n")
        os.replace(tmp, folder / RECORD)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    os.replace(built, folder / LIBRARY)
    return folder / LIBRARY
