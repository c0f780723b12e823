"""Whole exports: a folder is built beside its destination and renamed into place only when complete.

    with staged_export(out) as work:      # locked; leftovers of killed exports swept
        ...write everything into work...   # on an exception `work` is deleted, `out` untouched
    # -> `out` is now exactly what was written (an older export there was replaced)

Rules (the one rule for every command that writes a folder):
- `out` may be missing, an empty folder, or a k3x export (a `manifest.json` that reads back) holding only
  what its manifest lists (`artifacts.listed_files`; `.tmp-*` staging leftovers of a killed stage count as
  k3x's); anything else is refused before any work starts and again before the rename (`FolderError`, one
  line naming the first foreign file) — nothing of the user's is ever overwritten or deleted. Refusing,
  not keeping: a kept file would sit in a folder whose manifest does not describe it (a `model.engine`
  built from the old ONNX would pair with the new one), and keeping it would turn the one atomic rename
  into a per-file merge.
- A lock (`flock` on `.<name>.k3x-lock` beside `out`) makes concurrent exports to one folder refuse
  instead of mixing; the kernel drops it when the holder dies, so a killed export never blocks the next.
- The holder of the lock sweeps `.<name>.k3x-tmp-*` / `.<name>.k3x-old-*` beside `out`: with the lock
  held, those can only be leftovers of a killed export.
- Replacing: the old export is renamed aside, the new one renamed in, then the old one deleted.
  `replaced_files` names what goes (the files the old manifest lists), for the command's one line saying so.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterator

from ..fileio import normal_permissions


class FolderError(RuntimeError):
    """A destination folder that k3x must not write (not ours, or being written by another export)."""


def _foreign(out: Path, manifest: dict) -> list[str]:
    """Paths in `out` (relative) that its manifest does not list: files or folders of someone else's."""
    from .artifacts import listed_files

    files, folders = listed_files(manifest)
    found = []
    for root, dirs, names in os.walk(out):
        rel = Path(root).relative_to(out)
        for n in sorted(dirs + names):
            p = (rel / n).as_posix()
            ours = n.startswith(".tmp-") or p in files or (p in folders and not (out / p).is_symlink())
            if not ours:
                found.append(p)
        dirs[:] = [d for d in dirs if (rel / d).as_posix() in folders]
    return found


def check_destination(out: Path) -> None:
    """Refuse `out` unless it is missing, empty, or a k3x export folder holding only what its manifest lists
    (which will be replaced)."""
    from .artifacts import ManifestError, read_manifest

    if not out.exists() and not out.is_symlink():
        return
    if not out.is_dir():
        raise FolderError(f"{out}: exists and is not a folder; refusing to replace it")
    if not any(out.iterdir()):
        return
    try:
        manifest = read_manifest(out)
    except ManifestError:
        raise FolderError(f"{out}: not empty and not a k3x export folder; refusing to write into it "
                          "(choose another --out, or empty it yourself)") from None
    foreign = _foreign(out, manifest)
    if foreign:
        more = f" (and {len(foreign) - 1} more)" if len(foreign) > 1 else ""
        raise FolderError(f"{out / foreign[0]}{more}: not listed in {out}'s manifest; refusing to replace the "
                          "export folder and lose it (move it out, or choose another --out)")


def replaced_files(out: Path) -> list[str]:
    """The files of the earlier k3x export in `out` that replacing it deletes (its manifest's list, sorted,
    manifest.json last); [] when `out` is missing, empty or not an export."""
    from .artifacts import ManifestError, listed_files, read_manifest

    try:
        files = listed_files(read_manifest(out))[0]
    except (ManifestError, OSError):
        return []
    return sorted(f for f in files if os.path.lexists(out / f) and f != "manifest.json") + ["manifest.json"]


def replaced_line(out: Path, files: list[str], most: int = 12) -> str:
    """One line naming what a write into `out` replaced (the first `most` names, then a count)."""
    more = f" and {len(files) - most} more" if len(files) > most else ""
    return f"replaced in {out}: {', '.join(files[:most])}{more}"


@contextlib.contextmanager
def folder_lock(out: Path) -> Iterator[None]:
    """The one writer lock of an export folder (`k3x export` and `k3x build-engine` both hold it): a flock on
    `.<name>.k3x-lock` beside the folder, dropped by the kernel if the holder dies."""
    out = Path(out).absolute()
    path = out.parent / f".{out.name}.k3x-lock"
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise FolderError(f"{out}: another k3x export or engine build is writing this folder right now; "
                              "wait for it to finish") from None
        try:  # the file may have been unlinked by the previous holder after we opened it: retry
            if os.fstat(fd).st_ino == os.stat(path).st_ino:
                break
        except FileNotFoundError:
            pass
        os.close(fd)
    try:
        yield
    finally:
        path.unlink(missing_ok=True)
        os.close(fd)


def sweep(out: Path) -> list[Path]:
    """Delete leftovers of killed exports beside `out` (call with the lock held); returns what went."""
    gone = []
    for p in out.parent.glob(f".{out.name}.k3x-*-*"):
        if p.name.startswith((f".{out.name}.k3x-tmp-", f".{out.name}.k3x-old-")):
            shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
            gone.append(p)
    return gone


@contextlib.contextmanager
def staged_export(out: str | Path) -> Iterator[Path]:
    """Yield an empty sibling folder of `out`; on success it replaces `out` whole (module docstring)."""
    out = Path(out).absolute()
    check_destination(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with folder_lock(out):
        sweep(out)
        work = Path(tempfile.mkdtemp(prefix=f".{out.name}.k3x-tmp-", dir=out.parent))
        try:
            normal_permissions(work)  # mkdtemp creates 0700
            yield work
            check_destination(out)  # still ours to replace
            old = None
            if out.exists():
                if any(out.iterdir()):
                    old = Path(tempfile.mkdtemp(prefix=f".{out.name}.k3x-old-", dir=out.parent))
                    os.replace(out, old)
                else:
                    out.rmdir()
            try:
                os.replace(work, out)
            except BaseException:
                if old is not None:
                    os.replace(old, out)
                raise
            if old is not None:
                shutil.rmtree(old, ignore_errors=True)
        finally:
            shutil.rmtree(work, ignore_errors=True)
